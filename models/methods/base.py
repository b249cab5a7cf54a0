"""The interface every position method implements: where it acts, its parameters and hooks, its
part of the computation from position ids, and what an audit may expect of it.

A method is a stateless object. The modules it acts in (the ``Decoder`` for input methods, each
``Attention`` for attention methods) own its parameters and buffers, so state-dict names stay
those of TransformerLens and of older checkpoints (``pos_embed.W_pos``, ``blocks.{l}.attn.W_rel_K``);
the method reads them, and the module's ``cfg``, at every call.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

INPUT = "input embedding"
"""Adds a vector to the token embeddings, once per model (learned, sinusoidal)."""
QK_ROTATION = "q/k rotation"
"""Rotates the projected queries and keys (RoPE); hooks ``hook_rot_q`` and ``hook_rot_k``."""
SCORE_BIAS = "score bias"
"""Adds a finite term to the attention scores before softmax; hook ``hook_pos_bias``."""
VALUE = "value term"
"""Adds a position term to the attention output (Shaw's a^V, when enabled)."""
PLACES = (INPUT, QK_ROTATION, SCORE_BIAS, VALUE)


class PositionMethod:
    """One position method: a name, where it acts, and its part of the forward pass.

    Class attributes (declarations the decoder, the audit and the sweep read):
        name: the config name (``DecoderConfig.position``).
        label: the name people write (``RoPE``, ``ALiBi``), used in reports.
        acts_on: the places of :data:`PLACES` where the method acts; empty for NoPE.
        absolute: True when the output depends on absolute positions, so adding a constant to
            every position id changes it (seed 002, step 8); relative methods and NoPE are not.
        convention: the sign and offset convention, in DESIGN.md's terms (query i, key j).
        config_fields: the ``DecoderConfig`` fields that parameterize the method.

    Subclasses override the hooks of the places they act on; the defaults do nothing. Every ``cfg``
    argument is the model's :class:`~nopelens.models.DecoderConfig` (not imported here: the config
    imports the methods to validate itself).
    """

    name: ClassVar[str]
    label: ClassVar[str]
    acts_on: ClassVar[frozenset[str]] = frozenset()
    absolute: ClassVar[bool] = False
    convention: ClassVar[str] = ""
    config_fields: ClassVar[tuple[str, ...]] = ()
    bias_kind: ClassVar[str | None] = None
    """How an audit can recompute a score bias: ``linear`` (a fixed slope times i - j, readable from
    the scores of any model), ``lookup`` (rows of the model's own learned table at relative ids,
    readable from a nopelens Decoder), None (no score bias)."""

    # ------------------------------------------------------------------ declarations
    @property
    def reads_positions(self) -> bool:
        """False only for NoPE, where the causal mask alone carries order."""
        return bool(self.acts_on)

    @property
    def per_layer(self) -> bool:
        """Attention methods may differ per layer; input methods act once, on the embeddings."""
        return INPUT not in self.acts_on

    def acts(self, place: str) -> bool:
        """Whether the method acts at ``place`` (one of :data:`PLACES`), given its declaration."""
        return place in self.acts_on

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    # ------------------------------------------------------------------ configuration
    @classmethod
    def validate_config(cls, cfg, used: bool) -> None:
        """Check the method's config fields (every config), and what must hold when it is ``used``.

        Raises:
            ValueError: naming the offending field.
        """

    def max_positions(self, cfg) -> int | None:
        """Number of positions the method can compute (a learned table's rows), None if unbounded."""
        return None

    def describe(self, cfg) -> dict:
        """Top-level entries the method adds to a report's model description (its parameters)."""
        return {}

    # ------------------------------------------------------------------ input embedding
    def add_input_parameters(self, decoder: nn.Module, cfg) -> None:
        """Register the parameters of an input method on the decoder (before the blocks)."""

    def input_vectors(self, decoder: nn.Module, position_ids: Tensor, dtype) -> Tensor | None:
        """``[batch, pos, d_model]`` vectors added to the token embeddings, or None."""
        return None

    # ------------------------------------------------------------------ attention
    def add_parameters(self, attn: nn.Module, cfg) -> None:
        """Register the method's parameters and buffers on one ``Attention`` module."""

    def share_parameters(self, decoder: nn.Module, cfg) -> None:
        """Let layers share parameters once every block is built (T5's one table); default none."""

    def rotate(self, attn: nn.Module, x: Tensor, position_ids: Tensor) -> Tensor:
        """Queries or keys ``[batch, pos, head_index, d_head]`` rotated to their positions."""
        return x

    def score_bias(self, attn: nn.Module, q: Tensor, query_positions: Tensor, key_positions: Tensor) -> Tensor | None:
        """The ``[batch, head_index, query_pos, key_pos]`` term added to the scores, or None."""
        return None

    def value_term(
        self, attn: nn.Module, pattern: Tensor, query_positions: Tensor, key_positions: Tensor
    ) -> Tensor | None:
        """A ``[batch, query_pos, head_index, d_head]`` term added to the attention output, or None."""
        return None

    def needs_explicit_scores(self, attn: nn.Module) -> bool:
        """True when the fused kernel cannot compute the method (e.g. it needs the pattern itself)."""
        return False


class LookupBias(PositionMethod):
    """A score bias read from a learned table at relative ids (Shaw, T5): what the audit recomputes.

    Subclasses declare ``table_name`` (e.g. ``a^K``), ``declared_offset`` and ``mirrored_offset``
    (e.g. ``clip(j - i)`` and ``clip(i - j)``) and implement :meth:`relative_ids` and
    :meth:`reference_bias`. The audit checks ``hook_pos_bias`` against the reference at the declared
    ids (step 5) and that the declared, not the mirrored (transposed) ids reproduce it (step 2).
    """

    bias_kind = "lookup"
    table_name: ClassVar[str]
    declared_offset: ClassVar[str]
    mirrored_offset: ClassVar[str]
    ids_evidence_name: ClassVar[str]
    value_table_name: ClassVar[str | None] = None
    value_formula: ClassVar[str | None] = None

    def relative_ids(self, cfg, query_positions: Tensor, key_positions: Tensor) -> Tensor:
        """Table row of each (query i, key j), int64 ``[batch, query_pos, key_pos]``."""
        raise NotImplementedError

    def reference_bias(self, attn: nn.Module, q: Tensor, ids: Tensor) -> Tensor:
        """The bias at table rows ``ids``, in the dtype of ``q`` (float64 in the audit)."""
        raise NotImplementedError

    def reference_value_term(self, attn: nn.Module, pattern: Tensor, ids: Tensor) -> Tensor | None:
        """The value term at table rows ``ids`` in the dtype of ``pattern``, None when there is none."""
        return None

    def lookup_formula(self, cfg) -> str:
        """The bias in words, for reports."""
        raise NotImplementedError

    def ids_evidence(self, cfg, ids: Tensor) -> list[int]:
        """What the audit reports of the table rows used (e.g. the offsets they stand for)."""
        return sorted(set(ids.tolist()))
