"""The census: one short forward pass that records what a hooked HF model's hooks carry, and the
full description built from it (:func:`describe`); learned sinks; refusals in one line."""

from __future__ import annotations

import re
import weakref
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..hooks import act_name
from ..placement import model_device
from .config import config_family, describe_config
from .description import ConfigError, HFDescription, UnsupportedModelError
from .layout import position_table

SINKS_IN_THE_SOFTMAX = frozenset({"learned"})
"""Sink kinds whose logit is known and sits in the softmax denominator (the pattern sums to 1 - p_sink)."""

_DESCRIPTIONS: "weakref.WeakKeyDictionary[Any, HFDescription]" = weakref.WeakKeyDictionary()
CENSUS_LENGTH = 6


def describe(bridge: Any) -> HFDescription:
    """The full description of a hooked HF causal LM: config plus one census forward pass.

    ``bridge`` is a ``TransformerBridge`` or a :class:`nopelens.models.adapters.HookedHFModel`
    (then ``adapter`` is ``forward hooks`` and ``scores_hook`` False: no pre-softmax scores).

    The result is remembered per bridge.

    Raises:
        UnsupportedModelError: as :func:`describe_config`, or when the bridge cannot run a forward
            pass (the error says which architecture and what failed).
    """
    if bridge in _DESCRIPTIONS:
        return _DESCRIPTIONS[bridge]
    hf = bridge.original_model
    static = describe_config(hf.config, type(hf).__name__)
    hooked = not hasattr(bridge, "blocks")  # a HookedHFModel: PyTorch hooks, no bridge
    extra = {} if hooked else {"cache_unreadable": config_family(hf.config).bridge_cache_broken}
    if hooked:
        reason = getattr(bridge, "reason", None)
        extra = dict(
            adapter="forward hooks",
            scores_hook=False,
            notes=static.notes + ((f"hooked with PyTorch forward hooks: {reason}",) if reason else ()),
        )
    description = replace(static, **census(bridge, static), position_ids_hook=_position_ids_hook(bridge))
    description = replace(description, **extra)
    _DESCRIPTIONS[bridge] = description
    return description


def census(bridge: Any, static: HFDescription) -> dict[str, Any]:
    """Run one short forward pass with an ``attention_mask`` and record what the hooks carry.

    Returns:
        ``fired`` (hook names that fired), ``scores_hook`` (softmax of ``hook_attn_scores`` over
        visible keys equals ``hook_pattern`` in every layer, and they are not the pattern itself)
        and ``causal_under_mask`` (every future key got zero weight).
    """
    length = CENSUS_LENGTH
    tokens = (torch.arange(2 * length).view(2, length) * 7 + 3) % static.d_vocab
    device = model_device(bridge)
    tokens = tokens.to(device)
    captured: dict[str, Tensor] = {}
    handles = []
    for name, point in bridge.hook_dict.items():

        def keep(x, hook, name=name):
            if isinstance(x, Tensor) and (name.endswith(("hook_pattern", "hook_attn_scores")) or name not in captured):
                captured[name] = x.detach()

        handles.append((point, point.add_hook(keep)))
    was_training = bridge.training
    bridge.eval()
    try:
        with torch.no_grad():
            bridge(tokens, attention_mask=torch.ones_like(tokens))
    except Exception as error:  # a bridge that builds but cannot run is refused, whatever it raised
        who = (
            f"TransformerLens bridges {static.architecture}"
            if hasattr(bridge, "blocks")
            else f"nopelens hooks {static.architecture}"
        )
        raise UnsupportedModelError(
            f"{who} but its forward pass fails ({type(error).__name__}: {_one_line(error)})"
        ) from None
    finally:
        bridge.train(was_training)
        for point, handle in handles:
            handle.hook.remove()
            if handle in point.fwd_hooks:
                point.fwd_hooks.remove(handle)
    future = torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), 1)
    scores_ok, causal = True, True
    try:
        sinks = learned_sinks(bridge.original_model, static)
    except UnsupportedModelError:
        sinks = None
    for layer in range(static.n_layers):
        pattern = captured.get(act_name("pattern", layer))
        scores = captured.get(act_name("attn_scores", layer))
        if pattern is None:
            continue
        if pattern.shape[-1] != length:
            raise UnsupportedModelError(
                f"the attention weights of {static.architecture} layer {layer} have "
                f"{pattern.shape[-1]} key columns for {length} tokens (not one per key token)"
            )
        if not bool(torch.isfinite(pattern).all()):
            raise UnsupportedModelError(
                f"{static.architecture} layer {layer} gives non-finite attention weights (NaN or inf) on a short "
                "input: check its weights for NaN or inf and its RoPE base (rope_theta, layer_rope_theta) for a "
                "positive value"
            )
        causal &= float(pattern[..., future].abs().max()) == 0.0
        if scores is None or torch.equal(scores, pattern) or sinks is None:
            scores_ok = False
            continue
        sink = sinks.get(layer) if static.layers[layer].sink in SINKS_IN_THE_SOFTMAX else None
        recomputed = softmax_with_sink(scores.double().masked_fill(future, float("-inf")), sink)
        scores_ok &= float((recomputed - pattern.double()).abs().max()) < _census_tolerance(pattern.dtype)
    return {"fired": frozenset(captured), "scores_hook": scores_ok, "causal_under_mask": causal}


_SINK_PARAMETER = re.compile(r"layers\.(\d+)\..*\bsinks$")


def sink_parameters(hf_model: Any) -> dict[int, tuple[str, Tensor]]:
    """Layer -> (parameter name, its logits ``[head_index]`` in float64) of every learned ``sinks``
    parameter of an HF model, read from the weights alone (no forward pass), whatever its
    description says: the ``nn.Parameter`` named ``sinks`` under ``layers.{l}`` (GPT-OSS, Flint,
    MiMo-V2-Flash, HY-V4, Granite SWA, DeepSeek V4: ``self.sinks = nn.Parameter(torch.empty(num_heads))``,
    e.g. ``deepseek_v4/modeling_deepseek_v4.py``). Each is one logit s_h per head that enters every
    query row's softmax as a key with a zero value (Granite SWA: as a sigmoid(lse - s_h) output scale).
    A bridge's name (``..._original_component.sinks``) is given as the model's own."""
    found = {}
    for name, param in hf_model.named_parameters():
        match = _SINK_PARAMETER.search(name)
        if match:
            found[int(match.group(1))] = (name.replace("._original_component", ""), param.detach().double().flatten())
    return dict(sorted(found.items()))


def learned_sinks(hf_model: Any, description: HFDescription) -> dict[int, Tensor]:
    """Layer -> its learned sink logits ``[head_index]`` (float64), for the layers the description
    says have a ``learned`` or ``output_scale`` sink (the ``sinks`` parameter of their attention,
    found by name; a bridge wraps it as ``..._original_component.sinks``).

    Raises:
        UnsupportedModelError: if a layer that declares such a sink has no ``sinks`` parameter.
    """
    found = {l: logits for l, (_, logits) in sink_parameters(hf_model).items()}
    declared = [l for l, layer in enumerate(description.layers) if layer.sink in ("learned", "output_scale")]
    missing = [l for l in declared if l not in found]
    if missing:
        raise UnsupportedModelError(
            f"{description.architecture} declares learned sinks in layers {missing} but has no sinks parameter there"
        )
    return {l: found[l] for l in declared}


def softmax_with_sink(scores: Tensor, sink: Tensor | None) -> Tensor:
    """softmax over the keys with one extra logit per head (the learned sink, zero value), sink column
    dropped: rows sum to 1 - p_sink (``eager_attention_forward`` in ``gpt_oss/modeling_gpt_oss.py``).
    ``sink`` None is the plain softmax. ``scores`` is ``[batch, head_index, query_pos, key_pos]``.

    Example:
        >>> p = softmax_with_sink(torch.zeros(1, 1, 1, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        >>> p.tolist(), round(1 - float(p.sum()), 6)  # three keys and the sink share equally
        ([[[[0.25, 0.25, 0.25]]]], 0.25)
    """
    if sink is None:
        return scores.softmax(-1)
    column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], -1).softmax(-1)[..., :-1]


def _census_tolerance(dtype: torch.dtype) -> float:
    """How far softmax(scores) may be from a pattern stored in ``dtype``: 1e-4, or 4 eps of a half dtype."""
    return max(1e-4, 4 * float(torch.finfo(dtype).eps))


def _position_ids_hook(bridge: Any) -> str | None:
    """``pos_embed.hook_in`` when the position table is a plain ``nn.Embedding`` fed position ids."""
    try:
        table = position_table(bridge.original_model)
    except UnsupportedModelError:
        return None
    plain = any(
        getattr(m, "weight", None) is table and type(m).forward is nn.Embedding.forward
        for m in bridge.original_model.modules()
    )
    return "pos_embed.hook_in" if plain and "pos_embed.hook_in" in bridge.hook_dict else None


def check_readable(description: HFDescription) -> None:
    """Refuse a model whose bridged attention nopelens cannot read right.

    Raises:
        UnsupportedModelError: when future keys get weight under an ``attention_mask`` (the bridge
            dropped the causal mask), or when no ``hook_pattern`` fires.
    """
    if not description.causal_under_mask:
        raise UnsupportedModelError(
            f"the attention of {description.architecture} (through its {description.adapter}) gives future keys "
            "nonzero weight when an attention_mask is passed (the causal mask is dropped); its patterns and "
            "activations would be wrong"
        )
    attention = [l for l, layer in enumerate(description.layers) if layer.mixer == "attention"]
    if attention and not description.fires(act_name("pattern", attention[0])):
        why = next((n for n in description.notes if n.startswith("hooked with")), None)
        raise UnsupportedModelError(
            f"no hook_pattern fires in {description.architecture} through its "
            f"{description.adapter} (its attention weights cannot be read)" + (f"; {why}" if why else "")
        )


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def refusing(action: Callable[[], Any], architecture: str, verb: str = "bridge") -> Any:
    """Run ``action``; turn whatever the bridge (or the hooks) raise into an :class:`UnsupportedModelError`."""
    try:
        return action()
    except (UnsupportedModelError, ConfigError):  # already one line naming the model or the field
        raise
    except Exception as error:
        who = "TransformerLens cannot bridge" if verb == "bridge" else "nopelens cannot hook"
        raise UnsupportedModelError(f"{who} {architecture} ({type(error).__name__}: {_one_line(error)})") from None
