"""Decoder configuration: one small dataclass, validated on construction.

The position method is the only thing that differs between the variants nopelens compares, so a
comparison is apples to apples. Where each method acts is the table of seed
``002_c993a97fc3f160f5.txt``:

========================  ==============  ==============================================
method                    ``position``    acts on
========================  ==============  ==============================================
NoPE                      ``nope``        nothing: only the causal mask carries order
learned absolute          ``learned``     input representation (table ``[n_ctx, d_model]``)
sinusoidal                ``sinusoidal``  input representation (fixed)
RoPE                      ``rope``        projected Q/K pairs
ALiBi                     ``alibi``       score bias before softmax
Shaw relative             ``shaw``        score (and optionally value), clipped offsets
T5 relative bias          ``t5``          score bias per head and bucketed distance
========================  ==============  ==============================================
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .methods import METHODS, PositionMethod, get_method, method_names
from .methods.nope import NoPE

if TYPE_CHECKING:
    import torch

INPUT_METHODS = method_names(per_layer=False)
"""Methods that add a vector to the input representation (one per model, not per layer)."""

ATTENTION_METHODS = method_names(per_layer=True)
"""Methods that act inside attention, and may differ from layer to layer."""

POSITION_METHODS = ATTENTION_METHODS + INPUT_METHODS
"""Every position method's name (``DecoderConfig.position``; ``"nope"`` is one of them)."""
NORMALIZATIONS = ("layernorm", "rmsnorm", "none")
ACT_FNS = ("gelu", "gelu_tanh", "relu", "silu")
_WRITTEN_WHEN_SET = ("t5_num_buckets", "t5_max_distance", "t5_shared", "score_scale")


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and position method of a :class:`~nopelens.models.Decoder`.

    Dimension names follow TransformerLens. Validation happens in ``__post_init__``; every problem
    raises ``ValueError`` naming the offending field.

    Attributes:
        d_vocab: vocabulary size; token ids must lie in ``[0, d_vocab)``.
        n_ctx: longest sequence the model is meant for. Only ``learned`` enforces it (its table has
            ``n_ctx`` rows); the other methods compute any position.
        n_layers: number of blocks.
        d_model: residual stream width.
        n_heads: attention heads per block; must divide ``d_model``.
        d_head: width of one head; defaults to ``d_model // n_heads``.
        d_mlp: hidden width of the MLP; defaults to ``4 * d_model``; 0 means attention-only blocks.
        act_fn: MLP non-linearity, one of ``gelu``, ``gelu_tanh`` (GPT-2's), ``relu``, ``silu``.
        normalization: ``layernorm``, ``rmsnorm`` or ``none`` (pre-norm blocks; ``none`` lets
            hand-set circuits write exact values).
        use_bias: biases in attention, MLP, normalization and unembedding.
        position: one method for every layer, or a list with one attention method per layer
            (hybrids such as NoPE in some layers and RoPE in others). The input methods
            ``learned`` and ``sinusoidal`` act once, on the embeddings, so they are given as a
            single string.
        rotary_fraction: RoPE's rho; the first ``rotary_dim = rho * d_head`` dims of each head are
            rotated, the rest pass through (partial RoPE, seed ``004_150f630256efbd1c.txt``).
        rotary_base: RoPE base b in theta_r = b^(-2r / rotary_dim).
        pairing: ``half`` (GPT-NeoX / HF Llama: dims r and r + rotary_dim/2) or ``interleaved``
            (GPT-J / Meta: dims 2r and 2r + 1).
        shaw_clip: Shaw's k; relative offsets j - i are clipped to ``[-k, k]`` (2k + 1 rows).
        shaw_values: also add relative value embeddings a^V (Shaw et al. 2018, eq. 3).
        t5_num_buckets: T5's num_buckets (HF ``relative_attention_num_buckets``); distances below
            half of it get a bucket each, the rest log-spaced buckets (Raffel et al. 2020).
        t5_max_distance: T5's max_distance; every distance from it on shares the last bucket.
        t5_shared: one T5 table for every ``t5`` layer, owned by the first of them (T5's and
            Kazemnejad et al.'s choice: block 0 computes the bias, the others reuse it); False
            (default) gives each ``t5`` layer its own table.
        score_scale: the factor on q.k in every layer's scores; None (default) is
            1 / sqrt(d_head) (Vaswani et al. 2017, eq. 1). T5 (Raffel et al. 2020) and the models
            of Kazemnejad et al. 2023 use 1.0 (the scale folded into the initialization).
        layer_norm_eps: epsilon of the normalization layers.
        init_std: standard deviation of the normal weight initialization.
    """

    d_vocab: int
    n_ctx: int
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    d_head: int | None = None
    d_mlp: int | None = None
    act_fn: str = "gelu"
    normalization: str = "layernorm"
    use_bias: bool = True
    position: str | tuple[str, ...] = "nope"
    rotary_fraction: float = 1.0
    rotary_base: float = 10000.0
    pairing: str = "half"
    shaw_clip: int = 16
    shaw_values: bool = False
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    t5_shared: bool = False
    score_scale: float | None = None
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.position, list):
            object.__setattr__(self, "position", tuple(self.position))
        if self.d_head is None and self.n_heads > 0:
            object.__setattr__(self, "d_head", self.d_model // self.n_heads)
        if self.d_mlp is None:
            object.__setattr__(self, "d_mlp", 4 * self.d_model)
        self._validate()

    def _validate(self) -> None:
        for name in ("d_vocab", "n_ctx", "n_layers", "d_model", "n_heads", "d_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.d_mlp, int) or self.d_mlp < 0:
            raise ValueError(f"d_mlp must be a non-negative integer, got {self.d_mlp!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must divide d_model={self.d_model} "
                f"(d_model % n_heads = {self.d_model % self.n_heads})"
            )
        if self.act_fn not in ACT_FNS:
            raise ValueError(f"act_fn must be one of {ACT_FNS}, got {self.act_fn!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        self._validate_position()
        used = {type(m) for m in self.layer_methods} | {type(self.input_method)}
        for cls in METHODS.values():
            cls.validate_config(self, used=cls in used)
        if self.score_scale is not None and (
            isinstance(self.score_scale, bool)
            or not isinstance(self.score_scale, (int, float))
            or not 0 < self.score_scale < math.inf
        ):
            raise ValueError(
                f"score_scale must be None (1/sqrt(d_head)) or a finite number > 0, got {self.score_scale!r}"
            )
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not self.init_std > 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std!r}")

    def _validate_position(self) -> None:
        attention, inputs = method_names(per_layer=True), method_names(per_layer=False)  # the live registry
        if isinstance(self.position, str):
            if self.position not in attention + inputs:
                raise ValueError(f"position must be one of {attention + inputs}, got {self.position!r}")
            return
        if len(self.position) != self.n_layers:
            raise ValueError(
                f"position lists one method per layer: got {len(self.position)} for n_layers={self.n_layers}"
            )
        for layer, method in enumerate(self.position):
            if method in inputs:
                raise ValueError(
                    f"position[{layer}]={method!r}: {method} acts on the input embeddings, once "
                    "per model; give it as a single string, not per layer"
                )
            if method not in attention:
                raise ValueError(f"position[{layer}] must be one of {attention}, got {method!r}")

    @property
    def input_position(self) -> str | None:
        """``learned`` or ``sinusoidal`` when the model adds position to its input, else None."""
        if isinstance(self.position, tuple) or get_method(self.position).per_layer:
            return None
        return self.position

    @property
    def layer_positions(self) -> tuple[str, ...]:
        """The attention-level method of each layer (``nope`` where position enters the input)."""
        if isinstance(self.position, tuple):
            return self.position
        method = NoPE.name if self.input_position else self.position
        return (method,) * self.n_layers

    @property
    def input_method(self) -> PositionMethod | None:
        """The method object acting on the input embeddings, or None."""
        return get_method(self.input_position) if self.input_position else None

    @property
    def layer_methods(self) -> tuple[PositionMethod, ...]:
        """The method object of each layer's attention (NoPE where position enters the input)."""
        return tuple(get_method(name) for name in self.layer_positions)

    @property
    def reads_positions(self) -> bool:
        """False only when no layer and no input method reads position ids (pure NoPE)."""
        return self.input_method is not None or any(m.reads_positions for m in self.layer_methods)

    @property
    def max_positions(self) -> int | None:
        """Positions the model can compute (a learned table's ``n_ctx`` rows), None if unbounded."""
        method = self.input_method
        return method.max_positions(self) if method is not None else None

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dims per head, ``rotary_fraction * d_head``."""
        return int(round(self.rotary_fraction * self.d_head))

    @property
    def content_scale(self) -> float:
        """The factor on q.k in the scores: ``score_scale``, or 1 / sqrt(d_head) when it is None."""
        return self.d_head**-0.5 if self.score_scale is None else float(self.score_scale)

    @property
    def position_name(self) -> str:
        """A short label of the position method, e.g. ``rope`` or ``nope+rope``."""
        if isinstance(self.position, str):
            return self.position
        return "+".join(dict.fromkeys(self.position))

    # TransformerLens reads these names (ActivationCache.apply_ln_to_stack, decompose_resid, ...)
    @property
    def normalization_type(self) -> str | None:
        """TransformerLens' name of ``normalization``: ``"LN"``, ``"RMS"`` or None (no norm)."""
        return {"layernorm": "LN", "rmsnorm": "RMS", "none": None}[self.normalization]

    @property
    def attn_only(self) -> bool:
        """True when the blocks have no MLP (``d_mlp == 0``), as TransformerLens names it."""
        return self.d_mlp == 0

    @property
    def default_prepend_bos(self) -> bool:
        """``to_tokens`` puts BOS at position 0 unless told not to (nopelens convention)."""
        return True

    @property
    def n_key_value_heads(self) -> None:
        """None: every head has its own keys and values (no grouped-query attention), as
        TransformerLens says it (``transformer_lens.patching`` reads it for ``k``/``v`` sweeps)."""
        return None

    # Runtime state, not configuration. TransformerLens' tools read the model's device, dtype and
    # use_attn_result flag from ``model.cfg``. They are not dataclass fields, so they never enter
    # to_dict(), the JSON, equality, hashing or zoo digests; a Decoder owns a private copy of its
    # config and keeps them current (on .to(), .half(), ... and set_use_attn_result).
    @property
    def device(self) -> "torch.device | None":
        """Device of the Decoder that owns this config; None for a config no model owns."""
        return self.__dict__.get("_device")

    @property
    def dtype(self) -> "torch.dtype | None":
        """Parameter dtype of the Decoder that owns this config; None for a config no model owns."""
        return self.__dict__.get("_dtype")

    @property
    def use_attn_result(self) -> bool:
        """Whether the owning Decoder computes each head's output ``attn.hook_result``
        (``Decoder.set_use_attn_result``); False for a config no model owns."""
        return self.__dict__.get("_use_attn_result", False)

    def _set_runtime(self, **state: Any) -> None:
        """Set runtime state (``device``, ``dtype``, ``use_attn_result``); only a Decoder calls this,
        on its own copy of the config."""
        for name, value in state.items():
            if name not in ("device", "dtype", "use_attn_result"):
                raise AttributeError(f"{name!r} is not runtime state of a DecoderConfig")
            object.__setattr__(self, f"_{name}", value)

    def replace(self, **changes: Any) -> "DecoderConfig":
        """A copy with some fields changed (and validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_dict` inverts it.

        Fields added after the first checkpoints were written (:data:`_WRITTEN_WHEN_SET`) appear only
        when they differ from their default, so older configs keep their JSON and zoo digests.
        """
        data = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in _WRITTEN_WHEN_SET:
            if data[name] == defaults[name]:
                del data[name]
        if isinstance(self.position, tuple):
            data["position"] = list(self.position)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DecoderConfig":
        """Build a config from :meth:`to_dict` output.

        Raises:
            ValueError: on unknown fields or invalid values.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DecoderConfig fields: {unknown}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)
