"""Any causal LM module hooked in one call, with no hand-written map: :func:`hook_any`.

The residual sites come from the module structure, checked by one census forward pass
(:func:`find_sites`); the attention comes from the computation itself (:mod:`nopelens.models.intercept`:
the ``scaled_dot_product_attention`` or softmax calls the pass makes), so q, k, v, the scores and the
pattern are read whichever module computes them.

Two structures are recognised, both checked on the census pass (every residual site
``[batch, pos, d_model]``, called once, and each block's input equal to the previous block's output):

- a list of blocks (``nn.ModuleList``/``nn.Sequential``) each making exactly one attention call
  (nanoGPT, minGPT, HF, litgpt, torch's ``TransformerEncoder``): ``blocks.{l}.hook_resid_pre`` is
  block l's input, ``hook_resid_post`` its output; where the blocks return only their branch and
  the loop adds it (``x = x + block(x)``, checked exactly), the stream is read at the next block's
  input, and after the last block at the input of the next module called (a final norm or unembedding);
- a flat list of sublayer entries, one attention call in some and none in others (an attention
  entry and the feed-forward entries after it make one block), where each entry adds its branch to
  the residual stream in a module of its own (x-transformers' ``layers``: ``[norms, block,
  Residual]``): the stream is read at those adds' outputs, and block 0's input at the first add's
  residual argument.

A model with no attention call (sigmoid attention, an SSM) is mapped by its list of blocks alone
and gets no attention sites.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from .adapters import HookedModule, _key, model_error, raised_by_model
from .hooks import act_name
from .intercept import AttentionInterceptor, infer_key_window, run_sdpa, run_softmax
from .masks import CAUSAL, KeyWindow

ATTENTION_POINTS = ("q", "k", "v", "attn_scores", "pattern")
"""What an intercepted attention call is read at, under ``blocks.{l}.attn.hook_*``."""


class UnmappableModelError(ValueError):
    """A model whose residual sites cannot be found from its structure; the message says which map to pass."""


@dataclass
class SiteMap:
    """What :func:`find_sites` chose: the site -> ``path`` / ``path:input[.N]`` map, and per block the
    module paths whose calls belong to it (for checking where each attention call runs)."""

    sites: dict[str, str]
    blocks: list[list[str]]
    attention: bool
    notes: list[str] = field(default_factory=list)

    def describe(self, name: str) -> str:
        lines = [
            f"hook_any: {name}: {len(self.blocks)} blocks"
            + ("" if self.attention else ", no attention call found (no attention sites)")
        ]
        lines += [f"  {site} <- {spec}" for site, spec in self.sites.items()]
        if self.attention:
            lines.append(f"  blocks.{{l}}.attn.hook_{{{','.join(ATTENTION_POINTS)}}} <- the l-th attention call")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


@dataclass
class _Call:
    path: str
    args: tuple
    output: Any
    stack: tuple[str, ...]


class _Census:
    """Every module call of one forward pass (path, positional inputs, output, enclosing modules),
    and the enclosing modules of each attention call."""

    def __init__(self, model: nn.Module):
        self.calls: list[_Call] = []
        self.attention: list[tuple[str, ...]] = []
        self.stack: list[str] = []
        self.model = model

    def run(self, tokens: Tensor) -> None:
        handles = []
        for path, module in self.model.named_modules():
            if not path:
                continue
            handles.append(module.register_forward_pre_hook(self._enter(path)))
            handles.append(module.register_forward_hook(self._leave(path)))
        try:
            with torch.no_grad(), AttentionInterceptor(self._attention):
                self.model(tokens)
        except Exception as error:
            if raised_by_model(error):
                raise model_error(self.model, tokens, error) from error
            raise
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, path):
        def hook(module, args):
            self.stack.append(path)

        return hook

    def _leave(self, path):
        def hook(module, args, output):
            self.stack.pop()
            first = output[0] if isinstance(output, tuple) and output else output
            self.calls.append(_Call(path, args, first, tuple(self.stack)))

        return hook

    def _attention(self, kind, func, args, kwargs):
        self.attention.append(tuple(self.stack))
        return func(*args, **kwargs)

    def count(self, path: str) -> int:
        return sum(call.path == path for call in self.calls)

    def call(self, path: str) -> _Call:
        return next(call for call in self.calls if call.path == path)


def _is_stream(value: Any, tokens: Tensor) -> bool:
    return isinstance(value, Tensor) and value.ndim == 3 and tuple(value.shape[:2]) == tuple(tokens.shape)


def _lists(model: nn.Module) -> list[tuple[str, list[str]]]:
    return [
        (path, [f"{path}.{name}" if path else name for name, _ in module.named_children()])
        for path, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential))
    ]


def _inside(stack: tuple[str, ...], path: str) -> bool:
    """Whether a call made with these modules running ran under ``path`` (which may itself never be
    called, as a ``ModuleList`` entry)."""
    return any(running == path or running.startswith(path + ".") for running in stack)


def _block_list(census: _Census, tokens: Tensor) -> SiteMap | None:
    """A list whose children each run once and make one attention call (or, with no attention call
    at all, whose children chain the residual stream)."""
    for _, children in _lists(census.model):
        if len(children) < 1 or any(census.count(child) != 1 for child in children):
            continue
        if census.attention:
            per_child = [sum(_inside(stack, child) for stack in census.attention) for child in children]
            if per_child != [1] * len(children) or len(census.attention) != len(children):
                continue
        calls = [census.call(child) for child in children]
        if not all(call.args and _is_stream(call.args[0], tokens) for call in calls):
            continue
        sites = {act_name("resid_pre", 0): f"{children[0]}:input"}
        if all(_is_stream(call.output, tokens) for call in calls) and all(
            torch.equal(calls[l].output, calls[l + 1].args[0]) for l in range(len(calls) - 1)
        ):
            sites.update({act_name("resid_post", l): child for l, child in enumerate(children)})
            return SiteMap(sites, [[child] for child in children], bool(census.attention))
        after = _next_input(census, calls[-1])  # blocks that return their branch: x = x + block(x)
        adds = [call.args[0] for call in calls[1:]] + ([after.args[0]] if after else [])
        if after is None or not all(
            torch.equal(adds[l], calls[l].args[0] + calls[l].output) for l in range(len(calls))
        ):
            continue
        sites.update({act_name("resid_post", l): f"{children[l + 1]}:input" for l in range(len(children) - 1)})
        sites[act_name("resid_post", len(children) - 1)] = f"{after.path}:input"
        note = (
            f"the blocks return their branch (x = x + block(x)): the stream is read at their inputs and {after.path}'s"
        )
        return SiteMap(sites, [[child] for child in children], bool(census.attention), [note])
    return None


def _next_input(census: _Census, last: _Call) -> _Call | None:
    """The first module called once after ``last`` (outside it) on a ``[batch, pos, d_model]`` input."""
    for call in census.calls[census.calls.index(last) + 1 :]:
        if call.path.startswith(last.path + ".") or not call.args or not isinstance(call.args[0], Tensor):
            continue
        if call.args[0].shape == last.args[0].shape and census.count(call.path) == 1:
            return call
    return None


def _add_call(entry: str, calls: list[_Call]) -> _Call | None:
    """The last call under ``entry`` that adds two residual-shaped inputs (its output is their sum)."""
    found = None
    for call in calls:
        if not (call.path == entry or call.path.startswith(entry + ".")):
            continue
        tensors = [arg for arg in call.args[:2] if isinstance(arg, Tensor)]
        if (
            len(tensors) == 2
            and isinstance(call.output, Tensor)
            and tensors[0].shape == tensors[1].shape == call.output.shape
            and torch.equal(call.output, tensors[0] + tensors[1])
        ):
            found = call
    return found


def _sublayer_list(census: _Census, tokens: Tensor) -> SiteMap | None:
    """A flat list of attention and feed-forward entries, each adding its branch in a module of its own."""
    if not census.attention:
        return None
    for _, entries in _lists(census.model):
        per_entry = [sum(_inside(stack, entry) for stack in census.attention) for entry in entries]
        if sum(per_entry) != len(census.attention) or per_entry[:1] != [1] or max(per_entry) != 1:
            continue
        adds = [_add_call(entry, census.calls) for entry in entries]
        if any(add is None or not _is_stream(add.output, tokens) for add in adds):
            continue
        residual = (
            1
            if all(torch.equal(adds[i].args[1], adds[i - 1].output) for i in range(1, len(adds)))
            else (0 if all(torch.equal(adds[i].args[0], adds[i - 1].output) for i in range(1, len(adds))) else None)
        )
        if residual is None or any(census.count(add.path) != 1 for add in adds):
            continue
        starts = [i for i, n in enumerate(per_entry) if n == 1]
        ends = [start - 1 for start in starts[1:]] + [len(entries) - 1]
        sites = {act_name("resid_pre", 0): f"{adds[0].path}:input.{residual}"}
        sites.update({act_name("resid_post", l): adds[end].path for l, end in enumerate(ends)})
        blocks = [
            [
                path
                for path, _ in census.model.named_modules()
                if any(path == e or path.startswith(e + ".") for e in entries[start : end + 1])
            ]
            for start, end in zip(starts, ends)
        ]
        note = (
            f"blocks are runs of sublayers of {len(entries)} entries; the residual stream is read at each entry's add"
        )
        return SiteMap(sites, blocks, True, [note])
    return None


def _embedding(census: _Census, tokens: Tensor) -> str | None:
    for call in census.calls:
        if (
            call.args
            and isinstance(call.args[0], Tensor)
            and call.args[0] is tokens
            and isinstance(call.output, Tensor)
            and call.output.ndim == 3
            and isinstance(census.model.get_submodule(call.path), nn.Embedding)
        ):
            return call.path
    return None


def example_tokens(model: nn.Module, n_tokens: int = 8) -> Tensor:
    """Two rows of ``n_tokens`` token ids below the first ``nn.Embedding``'s vocabulary (seed 0)."""
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    vocab = embeddings[0].num_embeddings if embeddings else 2
    return torch.randint(0, vocab, (2, n_tokens), generator=torch.Generator().manual_seed(0))


def find_sites(model: nn.Module, tokens: Tensor | None = None) -> SiteMap:
    """The residual sites of a causal LM module, found from its structure and one census forward pass.

    Args:
        model: any module called as ``model(tokens)``; put it in eval mode first.
        tokens: int64 ``[batch, pos]`` for the census (default: :func:`example_tokens`).

    Returns:
        A :class:`SiteMap` (``hook_embed``, ``blocks.0.hook_resid_pre``, ``blocks.{l}.hook_resid_post``).

    Raises:
        UnmappableModelError: if neither structure of the module docstring fits, saying which map to pass
            (or, where a module's output holds NaN, naming the first such module).
    """
    tokens = example_tokens(model) if tokens is None else tokens
    census = _Census(model)
    census.run(tokens)
    found = _block_list(census, tokens) or _sublayer_list(census, tokens)
    if found is None:
        _refuse_non_finite(census)
        lists = (
            ", ".join(
                f"{path or '(the model)'}: {len(children)} entries, run {[census.count(c) for c in children]} times"
                for path, children in _lists(model)
            )
            or "none"
        )
        raise UnmappableModelError(
            f"cannot find the residual stream of {type(model).__name__}: no list of blocks that each run once, make "
            f"one attention call ({len(census.attention)} attention calls seen) and pass on a [batch, pos, d_model] "
            f"state (module lists: {lists}); pass "
            "sites={'blocks.0.hook_resid_pre': 'PATH:input', 'blocks.{l}.hook_resid_post': 'PATH', ...} "
            "(hook_any(model, sites=...))"
        )
    embed = _embedding(census, tokens)
    if embed is not None:
        found.sites = {"hook_embed": embed, **found.sites}
    return found


def _refuse_non_finite(census: _Census) -> None:
    """Raise if a call's output is a NaN-holding tensor (the blocks' chain cannot be checked on it)."""
    for call in census.calls:
        if isinstance(call.output, Tensor) and call.output.is_floating_point() and call.output.isnan().any():
            raise UnmappableModelError(
                f"{type(census.model).__name__}'s forward pass gives NaN at {call.path} on the "
                "census input, so its residual stream cannot be traced: check its weights"
            )


class HookedAny(HookedModule):
    """A :class:`~nopelens.models.adapters.HookedModule` whose attention is read from the computation.

    Besides its residual sites, block l has ``blocks.{l}.attn.hook_q``, ``hook_k``, ``hook_v``
    (``[batch, pos, head_index, d_head]``, from a ``scaled_dot_product_attention`` call),
    ``hook_attn_scores`` and ``hook_pattern`` (``[batch, head_index, query_pos, key_pos]``). The k-th
    attention call of a forward pass is block k's; a call made outside block k's modules, or a pass
    with another number of calls than blocks, is refused. ``key_windows`` holds, per block, the
    sliding window or chunk its last intercepted call was made under (blocks under the causal rule
    are not listed; ``unknown_masks`` lists the blocks whose mask is neither), so reads need no
    ``windows=``; ``sink_blocks`` the blocks whose softmax carried a learned sink's logit (one key
    more than queries): their patterns sum to 1 - p_sink, and :func:`nopelens.probes.collect`
    records them so that ``sink_table`` reports the sink's mass.

    Args:
        model: the module; sites: as :class:`HookedModule`; blocks: per block, the module paths
            whose calls belong to it (empty lists: not checked); attention: add the attention sites.
    """

    def __init__(
        self,
        model: nn.Module,
        sites: Mapping[str, str],
        blocks: list[list[str]],
        attention: bool = True,
        output_fn: Callable[[Any], Tensor] | None = None,
    ):
        attention_sites = (
            [act_name(name, l) for l in range(len(blocks)) for name in ATTENTION_POINTS] if attention else []
        )
        super().__init__(model, sites, output_fn)
        self.n_blocks, self.attention = len(blocks), attention
        self.points.update({_key(name): HookPoint() for name in attention_sites})
        for name in attention_sites:
            self.hook_dict[name] = self.points[_key(name)]
            self.points[_key(name)].name = name
        self.mod_dict.update(self.hook_dict)
        self.key_windows: dict[int, KeyWindow] = {}
        self.unknown_masks: set[int] = set()
        self.sink_blocks: set[int] = set()  # blocks whose softmax carries a learned sink's column
        self._inside: list[int] = []  # the blocks whose modules are running
        self._calls_made: list[int] = []
        modules = dict(model.named_modules())
        for l, paths in enumerate(blocks):
            for path in paths:
                self._handles.append(modules[path].register_forward_pre_hook(self._enter(l)))
                self._handles.append(modules[path].register_forward_hook(self._leave()))

    def _enter(self, block: int):
        def hook(module, args):
            self._inside.append(block)

        return hook

    def _leave(self):
        def hook(module, args, output):
            self._inside.pop()

        return hook

    def _point(self, block: int):
        def point(name: str, value: Tensor) -> Tensor:
            return self.hook_dict[act_name(name, block)](value)

        return point

    def _wants(self, block: int):
        return lambda name: bool(self.hook_dict[act_name(name, block)]._forward_hooks)

    def _attention_call(self, kind, func, args, kwargs):
        block = len(self._calls_made)
        if block >= self.n_blocks:
            raise ValueError(
                f"{type(self.model).__name__} made more attention calls than its {self.n_blocks} blocks "
                "in one forward pass; map it by hand (HookedModule)"
            )
        if self._inside and self._inside[-1] != block:
            raise ValueError(
                f"attention call {block} of {type(self.model).__name__} ran inside block "
                f"{self._inside[-1]}, not block {block}: the calls do not map one to one onto the blocks"
            )
        self._calls_made.append(block)
        if kind == "sdpa":
            out, visible = run_sdpa(func, args, kwargs, self._point(block), self._wants(block))
        else:
            out, visible, sink = run_softmax(func, args, kwargs, self._point(block))
            if sink:
                self.sink_blocks.add(block)
        self._record_mask(block, visible)
        return out

    def _record_mask(self, block: int, visible: Tensor) -> None:
        keys, n = infer_key_window(visible), visible.shape[-1]
        if keys is None:
            self.unknown_masks.add(block)
            self.key_windows.pop(block, None)
            return
        held = self.key_windows.get(block)
        if keys == CAUSAL and held is not None and n <= (held.window or held.chunk):
            return  # a sequence no longer than the window: it shows no window, and needs none
        self.unknown_masks.discard(block)
        if keys == CAUSAL:
            self.key_windows.pop(block, None)
        else:
            self.key_windows[block] = keys

    def forward(self, tokens: Tensor, **kwargs) -> Tensor:
        if not self.attention:
            return super().forward(tokens, **kwargs)
        self._calls_made, self._inside = [], []
        with AttentionInterceptor(self._attention_call):
            out = super().forward(tokens, **kwargs)
        if len(self._calls_made) != self.n_blocks:
            raise ValueError(
                f"{type(self.model).__name__} made {len(self._calls_made)} attention calls in one forward "
                f"pass, not one per block ({self.n_blocks})"
            )
        return out


def hook_any(
    model: nn.Module,
    sites: Mapping[str, str] | None = None,
    *,
    tokens: Tensor | None = None,
    attention: bool | None = None,
    output_fn: Callable[[Any], Tensor] | None = None,
    verbose: bool = True,
) -> HookedAny:
    """Hook any causal LM module at TransformerLens site names, with no hand-written map.

    Finds the residual sites (:func:`find_sites`), prints the map it chose (so it can be checked, or
    passed back changed as ``sites``), and reads the attention from the computation (:class:`HookedAny`).

    Args:
        model: the module, called as ``model(tokens)``; it is put in eval mode.
        sites: site -> ``path``, ``path:input`` or ``path:input.N`` (as :class:`HookedModule`); given,
            it replaces the residual map found (the census pass still finds the blocks' attention calls).
        tokens: the census input (default: :func:`example_tokens`).
        attention: add the attention sites (default: when the census saw attention calls).
        output_fn: turns the model's output into logits (default: ``.logits`` if present).
        verbose: print the map to stderr.

    Returns:
        A :class:`HookedAny`; ``collect``, ``sink_table`` and the probes read it like a ``Decoder``.

    Raises:
        UnmappableModelError: if no map is found and none is given (one line saying which to pass).
        KeyError: if a given path does not exist.
    """
    model.eval()
    try:
        found = find_sites(model, tokens)
    except UnmappableModelError:
        if sites is None:
            raise
        found = SiteMap(dict(sites), [[] for name in sites if name.endswith("hook_resid_post")], False)
    if sites is not None:
        found.sites = dict(sites)  # HookedModule checks the paths
    attention = found.attention if attention is None else attention
    if verbose:
        print(found.describe(type(model).__name__), file=sys.stderr)
    return HookedAny(model, found.sites, found.blocks, attention, output_fn)


def no_attention_reason(model: nn.Module) -> str:
    """Why a forward pass of ``model`` recorded no softmax attention, in words (for a refusal)."""
    fused = [path for path, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    if fused:
        return (
            f"its nn.MultiheadAttention ({fused[0]}{f' and {len(fused) - 1} more' if len(fused) > 1 else ''}) "
            "computes attention inside one fused call that hook_any does not see; map hook_pattern by hand "
            "(HookedModule) or call scaled_dot_product_attention"
        )
    return (
        "its forward pass makes no softmax attention call (scaled_dot_product_attention, or a softmax over "
        "[batch, head, query, key]; sigmoid or linear attention is no distribution)"
    )


def load_factory(ref: str) -> nn.Module:
    """The module a user's own factory builds: ``path/to/file.py:make_model`` or ``package.module:make_model``,
    called with no arguments (the file runs as a module named after it; nothing is unpickled).

    A file runs with its own folder first on ``sys.path`` (as ``python file.py`` would), so it may
    import its neighbours.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if ``ref`` has no ``:FUNCTION``, importing the file or module raises, the function
            is missing, or calling it raises (the line names the factory and the error).
        TypeError: if it returns no ``nn.Module``.
    """
    source, _, name = ref.rpartition(":")
    if not source or not name.isidentifier():
        raise ValueError(f"factory {ref!r}: write FILE.py:FUNCTION or package.module:FUNCTION")
    if source.endswith(".py") and not Path(source).is_file():
        raise FileNotFoundError(f"factory {ref!r}: no such file {source}")
    try:
        module = _import(source)
    except (Exception, SystemExit) as error:  # the user's code (a script parsing sys.argv exits): one line naming it
        raise ValueError(f"factory {ref!r}: importing {source} raised {type(error).__name__}: {error}") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"factory {ref!r}: {source} defines no function {name}")
    try:
        model = factory()
    except (Exception, SystemExit) as error:  # the user's code: one line naming it, not a traceback from inside it
        raise ValueError(f"factory {ref!r} raised {type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"factory {ref!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _import(source: str):
    """The module of ``source``: a ``.py`` file (its folder on ``sys.path`` while it is imported), or a
    dotted module name."""
    if not source.endswith(".py"):
        return importlib.import_module(source)
    path = Path(source).resolve()
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
