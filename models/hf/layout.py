"""Where an HF causal LM keeps what nopelens hooks without TransformerBridge (:func:`hook_layout`),
its learned position table, and whether its family can be read or bridged at all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import Tensor, nn

from .config import config_family, describe_config, text_config
from .description import HFDescription, UnsupportedModelError
from .family import declared, family_of

MIXER_NAMES = ("self_attn", "attention", "attn", "self_attention", "linear_attn", "mamba", "mixer")
"""Child names of a decoder layer's attention or other sequence mixer, in the order looked for."""
ATTENTION_NAMES = MIXER_NAMES[:4]
"""Names of a softmax attention, looked for deeper in a layer that has no mixer child (Zamba's
hybrid layers keep theirs under ``shared_transformer.self_attn`` next to a ``mamba_decoder``)."""


@dataclass(frozen=True)
class HookLayout:
    """Where :class:`nopelens.models.adapters.HookedHFModel` hooks an HF causal LM (module paths).

    Attributes:
        embed: the token embedding.
        layers: each decoder layer.
        mixers: each layer's attention or other mixer (None for an MLP-only block).
        attention: whether that mixer is softmax attention returning its weights.
        final_norm: the norm before the unembedding, or None.
        values, outputs: each attention's value projection (``v_proj``, whose output is
            ``hook_v``) and output projection (``o_proj``, whose input is ``hook_z``), or None.
        d_head: the head size ``hook_v``/``hook_z`` are split by.
        outputs_at: per layer, where ``hook_resid_post`` sits: ``(path, "output")`` (a module's
            output) or ``(path, "input")`` (the next sublayer's input); empty: each layer's output.
        biases: per layer, the module whose output is the attention's position bias
            (``hook_pos_bias``, the family's ``position_bias_module``), or None.
    """

    embed: str
    layers: tuple[str, ...]
    mixers: tuple[str | None, ...]
    attention: tuple[bool, ...]
    final_norm: str | None
    values: tuple[str | None, ...] = ()
    outputs: tuple[str | None, ...] = ()
    d_head: int = 0
    outputs_at: tuple[tuple[str, str], ...] = ()
    biases: tuple[str | None, ...] = ()


def hook_layout(hf_model: Any) -> HookLayout:
    """Find the embedding, decoder layers, mixers and final norm of an HF causal LM.

    The decoder layers are the ``nn.ModuleList`` with one entry per ``num_hidden_layers`` (the
    one under ``model.layers`` where there is one; a family that declares ``sublayers`` has one
    entry per group of sublayers); a layer's mixer is its first child named as in
    :data:`MIXER_NAMES`, else (an attention layer) its shallowest module named as in
    :data:`ATTENTION_NAMES`; it is attention when the config says so (:func:`describe_config`).

    Raises:
        UnsupportedModelError: if no such layer list (or embedding) is found.
    """
    static = describe_config(hf_model.config, type(hf_model).__name__)
    family = config_family(hf_model.config)
    modules = dict(hf_model.named_modules())
    sublayers = family.sublayers
    outputs_at: tuple[tuple[str, str], ...] = ()
    if sublayers:
        attn, norm_name = sublayers
        root = _decoder_list(modules, static, lambda m: True)
        per_layer = len(modules[f"{root}.0.{attn}"])
        if per_layer * len(modules[root]) != static.n_layers:
            raise UnsupportedModelError(
                f"{static.architecture}: {len(modules[root])} decoder layers of {per_layer} "
                f"attention sublayers are not its {static.n_layers} layers"
            )
        block = [f"{root}.{l // per_layer}" for l in range(static.n_layers)]
        layers = tuple(
            path if l % per_layer == 0 else f"{path}.{norm_name}.{l % per_layer}" for l, path in enumerate(block)
        )
        mixers = [f"{path}.{attn}.{l % per_layer}" for l, path in enumerate(block)]
        outputs_at = tuple(
            (layers[l + 1], "input") if (l + 1) % per_layer else (path, "output") for l, path in enumerate(block)
        )
    embedding = hf_model.get_input_embeddings()
    embed = next((name for name, m in modules.items() if m is embedding), None)
    if embed is None:
        raise UnsupportedModelError(f"cannot find the token embedding of {static.architecture}")
    if not sublayers:
        # a multimodal wrapper: the decoder layers beside the token embedding, not a vision tower's
        beside = embed.rsplit(".", 1)[0] + "." if text_config(hf_model.config) is not hf_model.config else ""
        root = _decoder_list(modules, static, lambda m: len(m) == static.n_layers, beside)
        layers = tuple(f"{root}.{l}" for l in range(static.n_layers))
        mixers = [_mixer_path(modules, path, spec.mixer == "attention") for path, spec in zip(layers, static.layers)]
    prefix = root.rsplit(".", 1)[0] if "." in root else ""
    norm = next(
        (
            f"{prefix}.{n}".lstrip(".")
            for n in ("norm", "final_layernorm", "ln_f", "final_norm")
            if f"{prefix}.{n}".lstrip(".") in modules
        ),
        None,
    )
    attention = tuple(layer.mixer == "attention" and mixer is not None for layer, mixer in zip(static.layers, mixers))

    def child(mixer: str | None, name: str, is_attention: bool) -> str | None:
        path = f"{mixer}.{name}"
        return path if is_attention and path in modules and isinstance(modules[path], nn.Linear) else None

    values = tuple(child(m, "v_proj", a) for m, a in zip(mixers, attention))
    outputs = tuple(child(m, "o_proj", a) for m, a in zip(mixers, attention))
    bias = family.position_bias_module
    biases = tuple(
        f"{m}.{bias}" if bias and a and f"{m}.{bias}" in modules else None for m, a in zip(mixers, attention)
    )
    # MiMo-V2-Flash: v heads differ from q/k heads
    v_head = int(getattr(text_config(hf_model.config), "v_head_dim", None) or static.d_head)
    return HookLayout(embed, layers, tuple(mixers), attention, norm, values, outputs, v_head, outputs_at, biases)


def _decoder_list(modules: dict, static: HFDescription, fits: Callable[[Any], bool], under: str = "") -> str:
    """The path of the ``nn.ModuleList`` of decoder layers: of the lists under ``under`` that
    ``fits``, the one named ``...layers`` nearest the root."""
    lists = [name for name, m in modules.items() if isinstance(m, nn.ModuleList) and fits(m) and name.startswith(under)]
    if not lists:
        raise UnsupportedModelError(f"cannot find the {static.n_layers} decoder layers of {static.architecture}")
    return min(lists, key=lambda name: (not name.endswith("layers"), name.count("."), name))


def _mixer_path(modules: dict, layer: str, attention: bool) -> str | None:
    """A decoder layer's mixer: its first child named as in :data:`MIXER_NAMES`, else, for an
    attention layer, its shallowest descendant named as in :data:`ATTENTION_NAMES`."""
    children = dict(modules[layer].named_children())
    found = next((f"{layer}.{n}" for n in MIXER_NAMES if n in children), None)
    if found is not None or not attention:
        return found
    deeper = [name for name in modules if name.startswith(f"{layer}.") and name.rsplit(".", 1)[-1] in ATTENTION_NAMES]
    return min(deeper, key=lambda name: name.count("."), default=None)


def unreadable(hf_model: Any) -> str | None:
    """Why nopelens cannot read an HF model at all (its family's ``unreadable``, or a layer type some
    family declares unreadable), or None."""
    config = text_config(getattr(hf_model, "config", None))
    why = family_of(str(getattr(config, "model_type", ""))).unreadable
    kinds = getattr(config, "layer_types", None) or ()
    return why or next((_unreadable_layer_types()[k] for k in kinds if k in _unreadable_layer_types()), None)


def _unreadable_layer_types() -> dict[str, str]:
    return {
        kind: why for model_type in declared() for kind, why in family_of(model_type).unreadable_layer_types.items()
    }


def bridge_refused(hf_model: Any) -> str | None:
    """Why a family goes to forward hooks although TransformerLens has an adapter for it, or None."""
    return family_of(str(getattr(text_config(getattr(hf_model, "config", None)), "model_type", ""))).bridge_refused


def position_tables() -> tuple[str, ...]:
    """Where the families with a learned table keep it (their ``position_table``), e.g. ``transformer.wpe``."""
    return tuple(dict.fromkeys(t for m in declared() if (t := family_of(m).position_table)))


def position_table(hf_model: Any) -> Tensor:
    """The learned position table ``[n_rows, d_model]`` of an HF model (rows include any offset).

    Raises:
        UnsupportedModelError: if the model keeps no table nopelens knows where to find.
    """
    modules = dict(hf_model.named_modules())
    for name in position_tables():
        for candidate in (name, f"{name}.original_component"):
            module = modules.get(candidate)
            if module is not None and isinstance(getattr(module, "weight", None), Tensor):
                return module.weight
    raise UnsupportedModelError(
        f"cannot find the learned position table of {type(hf_model).__name__} "
        f"(looked for {', '.join(position_tables())})"
    )
