"""What the audit needs of a model (:class:`Subject`), and the nopelens ``Decoder`` as one.

A subject exposes the per-layer position methods (the method objects of
:mod:`nopelens.models.methods`), runs the model with explicit position ids and hooks, captures the
position ids it used, decodes through its KV cache, and drops its score biases. The HF subject
(a model bridged by TransformerLens) lives in :mod:`.hf`.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from jaxtyping import Float
from torch import Tensor

from nopelens.models import Decoder, KVCache
from nopelens.models.hooks import act_name
from nopelens.models.masks import CAUSAL, KeyWindow
from nopelens.models.methods import METHODS, QK_ROTATION, SCORE_BIAS, PositionMethod, get_method

from .numerics import dot_scores


class DecodingUnavailable(RuntimeError):
    """Raised by :meth:`Subject.decode_incrementally` when the model's own KV cache cannot run; step 9
    is then not applicable, with this message as its reason."""


@dataclass
class RopeSpec:
    """RoPE as the model declares it: rotated dims per head, base b and pair layout."""

    rotary_dim: int
    base: float
    pairing: str


class Subject(abc.ABC):
    """What the audit needs of a model, whatever its implementation."""

    kind: str
    name: str
    layer_methods: tuple[PositionMethod, ...]
    input_method: PositionMethod | None
    n_heads: int
    d_head: int
    d_vocab: int
    max_positions: int | None
    rope: RopeSpec | None = None
    details: dict[str, Any]
    special_tokens: dict[str, Any]
    model: Any

    @property
    def n_layers(self) -> int:
        return len(self.layer_methods)

    @property
    def uses_positions(self) -> bool:
        return self.input_method is not None or any(m.reads_positions for m in self.layer_methods)

    @property
    def positions_reach_output(self) -> bool:
        """Some position the model reads can change its output: an input position method, an
        absolute layer method, or a layer reading positions whose queries see more than their own
        key (under a window or chunk of 1 a relative method meets offset 0 only, and the softmax
        over one key is 1 whatever the score)."""
        return self.input_method is not None or any(
            m.reads_positions and not self.offset_zero_only(layer) for layer, m in enumerate(self.layer_methods)
        )

    def offset_zero_only(self, layer: int) -> bool:
        """The layer's method reads only offsets, and each query sees only its own key (a window or
        chunk of 1): offset 0 is all it meets."""
        method = self.layer_methods[layer]
        return not method.absolute and self.key_window(layer).only_self

    @property
    def layer_labels(self) -> list[str]:
        """Each layer's method in a few words (with its window, sink and rotated part where it has them)."""
        return self.layer_names

    @property
    def layer_names(self) -> list[str]:
        return [m.name for m in self.layer_methods]

    @property
    def input_name(self) -> str | None:
        return None if self.input_method is None else self.input_method.name

    @property
    def method_names(self) -> list[str]:
        """The distinct attention methods, sorted by name."""
        return sorted(set(self.layer_names))

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (its first floating-point parameter's); sets the tolerances."""
        for param in self.model.parameters():
            if param.is_floating_point():
                return param.dtype
        return torch.float32

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a softmax attention pattern (all of them, unless the model has other mixers)."""
        return list(range(self.n_layers))

    def key_window(self, layer: int) -> KeyWindow:
        """The sliding window or chunk of a layer's attention (none: the causal rule alone)."""
        return CAUSAL

    def layers_acting(self, place: str) -> list[int]:
        """The layers whose method acts at ``place`` (a :data:`~nopelens.models.methods.PLACES` entry)."""
        return [layer for layer, m in enumerate(self.layer_methods) if m.acts(place)]

    def describe(self) -> dict[str, Any]:
        desc = f"{self.kind}; input positions: {self.input_name or 'none'}; per layer: {_runs(self.layer_labels)}"
        out = {
            "name": self.name,
            "kind": self.kind,
            "description": desc,
            "input_position": self.input_name,
            "layer_positions": self.layer_names,
            "attention_methods": self.method_names,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "d_head": self.d_head,
            "d_vocab": self.d_vocab,
            "max_positions": self.max_positions,
        }
        out.update(self.details)
        return out

    @property
    def reads_tables(self) -> bool:
        """Whether the audit can read the model's own position tables (a nopelens Decoder)."""
        return False

    @property
    def content_hook(self) -> str:
        """The hook holding a layer's content (q.k) scores, or its whole scores where none is separate."""
        return "hook_attn_scores"

    @abc.abstractmethod
    def forward(
        self, tokens: Tensor, mask: Tensor, position_ids: Tensor | None = None, fwd_hooks: Any = ()
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Logits, with explicit position ids (an intervention) and TransformerLens hooks."""

    @abc.abstractmethod
    def run_with_cache(
        self, tokens: Tensor, mask: Tensor, position_ids: Tensor | None = None
    ) -> tuple[Tensor, Any, Tensor | None]:
        """Logits, the audited activations and the position ids the model used (None if unseen)."""

    @abc.abstractmethod
    def capture_position_ids(self) -> contextlib.AbstractContextManager[list]:
        """A context collecting, per forward pass, the position ids of the new tokens."""

    @abc.abstractmethod
    def decode_incrementally(self, tokens: Tensor, mask: Tensor, split: int) -> tuple[Tensor, dict[str, Any]]:
        """Logits of a prefix of ``split`` tokens then one token at a time through the KV cache,
        and the position ids assigned on the way (``step_ids``; ``cache_ids`` where the cache
        records them)."""

    @abc.abstractmethod
    def forward_without_bias(self, tokens: Tensor, mask: Tensor, fwd_hooks: Any, rows: slice = slice(None)) -> bool:
        """Run with every finite score bias dropped in batch rows ``rows`` (and the given hooks);
        False where impossible."""

    def score_scale(self, layer: int) -> float:
        """The factor multiplying q.k in a layer's scores: 1 / sqrt(d_head)."""
        return self.d_head**-0.5

    def rope_spec(self, layer: int) -> RopeSpec | None:
        """The RoPE parameters of a layer, None where the layer does not rotate."""
        return self.rope if self.layer_methods[layer].acts(QK_ROTATION) else None

    def content_scores(self, q: Tensor, k: Tensor, layer: int) -> Tensor:
        """A layer's content scores from the q and k entering them: q.k * score_scale."""
        return dot_scores(q, k, self.score_scale(layer))

    def decoding_unreadable(self) -> str | None:
        """Why decoding through the model's KV cache cannot be audited, or None."""
        return None

    def decoding_caveat(self) -> str | None:
        """A known cause of cached logits that differ from the full forward's (shown with the failure), or None."""
        return None

    def sink(self, layer: int) -> tuple[str | None, Tensor | None]:
        """A layer's extra attention sink: (kind, per-head logits) as
        :attr:`nopelens.models.hf.LayerPosition.sink` names it, or (None, None)."""
        return None, None

    def query_scale(self, layer: int):
        """A layer's position-dependent query factor (:class:`nopelens.models.hf.QueryScale`), or None."""
        return None

    def qk_unreadable(self, layer: int) -> str | None:
        """Why a layer's hooked q and k cannot be held against the reference, or None (they can)."""
        return None

    def qk_names(self, layer: int) -> tuple[str, str]:
        """The attention hooks holding the q and k that enter the scores (before rotation)."""
        return "hook_q", "hook_k"

    def prepare_qk(self, q: Tensor, k: Tensor, layer: int) -> tuple[Tensor, Tensor]:
        """What the model does to the hooked q and k before the scores, besides rotating them."""
        return q, k

    @property
    def scores_trusted(self) -> bool:
        """``hook_attn_scores`` are the pre-softmax scores behind ``hook_pattern``."""
        return True

    @property
    def takes_positions(self) -> bool:
        """Position ids can be handed to the model (interventions, step 8)."""
        return True

    def unverifiable(self) -> str | None:
        """Why the position steps cannot be verified at all, or None."""
        return None

    def relative_bias(self, layer: int) -> int | None:
        """The extent of a layer's learned bias by token-index distance (zero at ``i - j >=`` it), or None."""
        return None

    def sparse_reason(self, length: int) -> str | None:
        """Why the masks of ``length``-token sequences are not the static window rule in some layer
        (a content-dependent sparse selection, :meth:`nopelens.models.hf.LayerPosition.sparse_reason`), or None."""
        return None

    def alibi_slopes(self, layer: int) -> Tensor:
        """Slopes m_h of a linear-bias layer, in score units per token (float64)."""
        return self.layer_methods[layer].reference_slopes(self.n_heads).double()


class DecoderSubject(Subject):
    kind = "nopelens Decoder"

    def __init__(self, model: Decoder, name: str):
        cfg = model.cfg
        self.model, self.name = model, name
        self.layer_methods = cfg.layer_methods
        self.input_method = cfg.input_method
        self.n_heads, self.d_head, self.d_vocab = cfg.n_heads, cfg.d_head, cfg.d_vocab
        self.max_positions = cfg.max_positions
        if self.layers_acting(QK_ROTATION):
            self.rope = RopeSpec(cfg.rotary_dim, cfg.rotary_base, cfg.pairing)
        used = set(self.layer_methods)
        self.details = {}
        for method in (get_method(name) for name in METHODS):  # registry order: stable report keys
            if method in used:
                self.details.update(method.describe(cfg))
        self.special_tokens = {"note": "a nopelens Decoder has no tokenizer; no special token ids are declared"}

    @property
    def reads_tables(self) -> bool:
        return True

    def score_scale(self, layer: int) -> float:
        """The declared factor on q.k: ``cfg.content_scale`` (1 / sqrt(d_head) unless ``score_scale`` is set)."""
        return self.model.cfg.content_scale

    @property
    def content_hook(self) -> str:
        return "hook_content_scores"

    def attention(self, layer: int):
        """The ``Attention`` module of a layer (owner of its method's parameters)."""
        return self.model.blocks[layer].attn

    @property
    def declaration(self):
        """The model's declared config (what a checkpoint stores): every reference the audit
        computes (RoPE's base and fraction, Shaw's clip, T5's buckets) comes from it, never from
        a layer's own copy, so a layer that deviates from the declaration fails."""
        return self.model.cfg

    def input_reference(self, position_ids: Tensor, width: int) -> Tensor:
        """What ``hook_pos_embed`` must be at the ids, float64, from the input method's formula."""
        return self.input_method.reference_vectors(self.model, position_ids, width)

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        return self.model.run_with_hooks(
            tokens, attention_mask=mask, position_ids=position_ids, fwd_hooks=list(fwd_hooks)
        )

    def run_with_cache(self, tokens, mask, position_ids=None):
        with self.capture_position_ids() as seen:
            logits, cache = self.model.run_with_cache(
                tokens, attention_mask=mask, position_ids=position_ids, names_filter=audited_hook
            )
        return logits, cache, seen[0]

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """Record the query position ids block 0 receives (what every layer uses)."""
        seen: list[Tensor] = []

        def hook(module, args):
            resid, key_positions = args[0], args[1]
            seen.append(key_positions[:, -resid.shape[1] :].detach().clone())

        handle = self.model.blocks[0].register_forward_pre_hook(hook)
        try:
            yield seen
        finally:
            handle.remove()

    def decode_incrementally(self, tokens, mask, split):
        cache = KVCache.empty(self.model.cfg, tokens.shape[0], tokens.device)
        pieces = []
        with self.capture_position_ids() as seen:
            pieces.append(self.model(tokens[:, :split], attention_mask=mask[:, :split], past_kv=cache))
            for t in range(split, tokens.shape[1]):
                pieces.append(self.model(tokens[:, t : t + 1], attention_mask=mask[:, t : t + 1], past_kv=cache))
        return torch.cat(pieces, 1), {"step_ids": torch.cat(seen, 1), "cache_ids": cache.position_ids}

    def forward_without_bias(self, tokens, mask, fwd_hooks, rows=slice(None)):
        def drop(x, hook):
            x = x.expand(tokens.shape[0], *x.shape[1:]).clone()
            x[rows] = 0
            return x

        zero = [(act_name("pos_bias", l), drop) for l in self.layers_acting(SCORE_BIAS)]
        self.forward(tokens, mask, None, zero + list(fwd_hooks))
        return True


def audited_hook(name: str) -> bool:
    """The hooks the audit reads: attention internals and the layer-0 input."""
    if name in ("hook_embed", "hook_pos_embed", "blocks.0.hook_resid_pre"):
        return True
    if name.endswith((".attn.q_norm.hook_out", ".attn.k_norm.hook_out")):  # OLMo-Hybrid's hooked full-width norms
        return True
    return ".attn.hook_" in name and name.rsplit(".", 1)[-1] in ATTENTION_HOOKS


ATTENTION_HOOKS = (
    "hook_q",
    "hook_k",
    "hook_q_normed",
    "hook_k_normed",
    "hook_v",
    "hook_rot_q",
    "hook_rot_k",
    "hook_content_scores",
    "hook_pos_bias",
    "hook_attn_scores",
    "hook_pattern",
    "hook_z",
    "hook_cos",
    "hook_sin",
)


def _runs(labels: list[str]) -> str:
    """Labels joined by ``; ``, a run of equal ones written once with its count.

    Example:
        >>> _runs(["rope", "rope", "rope", "nope", "rope"])
        'rope ×3; nope; rope'
    """
    runs = [(label, len(list(run))) for label, run in itertools.groupby(labels)]
    return "; ".join(label if n == 1 else f"{label} ×{n}" for label, n in runs)
