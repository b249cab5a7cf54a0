"""HF models as audit subjects: which position method an HF config uses, and how to run, hook and
read positions of an HF causal LM bridged by TransformerLens.

All knowledge of HF model families in the audit lives here (the model types and config keys that
name a position method, RoPE's parameters, Bloom's ALiBi tensor, where a learned table sits), so it
can move as one piece into a module that describes HF models per layer.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict
from typing import Any, Iterator

import torch
from torch import Tensor

from nopelens.models.methods import QK_ROTATION, SCORE_BIAS, get_method
from nopelens.models.methods.nope import NoPE
from nopelens.models.positions import alibi_slopes, rope_angles

from .numerics import as_ids
from .subjects import RopeSpec, Subject, audited_hook

HF_METHODS = {"gpt2": "learned", "gpt_neox": "rope", "llama": "rope", "mistral": "rope", "qwen2": "rope",
              "gptj": "rope", "bloom": "alibi", "gpt_neo": "learned"}
"""Position method (a registry name) of the HF model types the audit knows by name."""



class BridgeSubject(Subject):
    kind = "HF causal LM via TransformerBridge"

    def __init__(self, bridge: Any, name: str):
        self.model, self.name = bridge, name
        hf = bridge.original_model
        config = hf.config
        self.config = config
        self.model_type = getattr(config, "model_type", type(hf).__name__)
        method = get_method(self._method_from_config(config))
        n_layers = len(bridge.blocks)
        self.n_heads = int(config.num_attention_heads)
        self.d_head = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        self.d_vocab = int(config.vocab_size)
        self.input_method = None if method.per_layer else method
        self.layer_methods = (method if method.per_layer else NoPE(),) * n_layers
        self.max_positions = None
        if self.input_method is not None:  # HF's input positions are learned tables
            self.max_positions = int(getattr(config, "n_positions", None) or config.max_position_embeddings)
        self.details = {}
        if method.acts(QK_ROTATION):
            self.rope = self._rope_from_config(config)
            self.details["rope"] = asdict(self.rope)
        # a score-bias family (Bloom) hands its bias to every block as an ``alibi`` tensor
        self.bias_as_alibi_tensor = method.acts(SCORE_BIAS)
        self.special_tokens = {k: getattr(config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        self.position_limit = 4096  # audit() sets it from the probe length

    def _method_from_config(self, config) -> str:
        if self.model_type in HF_METHODS:
            return HF_METHODS[self.model_type]
        if getattr(config, "alibi", False):
            return "alibi"
        if getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None):
            return "rope"
        if getattr(config, "position_embedding_type", None) == "absolute":
            return "learned"
        raise ValueError(
            f"cannot tell the position method of HF model_type {self.model_type!r} from its config; "
            f"known: {sorted(HF_METHODS)}"
        )

    def _rope_from_config(self, config) -> RopeSpec:
        params = dict(getattr(config, "rope_parameters", None) or {})
        legacy_base = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", 10000.0)
        base = params.get("rope_theta", legacy_base)
        fraction = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
                              or getattr(config, "rotary_pct", None) or 1.0)
        rotary_dim = int(getattr(config, "rotary_dim", None) or round(self.d_head * float(fraction)))
        pairing = "interleaved" if self.model_type in ("gptj", "codegen") else "half"
        if params.get("rope_type", "default") != "default":
            raise ValueError(
                f"rope_type {params['rope_type']!r} scales RoPE frequencies; the audit's reference "
                "covers the default (unscaled) RoPE only"
            )
        return RopeSpec(rotary_dim, float(base), pairing)

    @property
    def _is_bloom(self) -> bool:
        return self.bias_as_alibi_tensor

    # --- running ---------------------------------------------------------------------------
    def _kwargs(self, mask, position_ids):
        kwargs = {"attention_mask": mask}
        if position_ids is not None and not self._is_bloom:
            kwargs["position_ids"] = position_ids
        return kwargs

    @contextlib.contextmanager
    def _alibi_positions(self, position_ids: Tensor | None) -> Iterator[None]:
        """Bloom takes no position ids: an intervention replaces its ALiBi tensor slope * p_j."""
        if position_ids is None or not self._is_bloom:
            yield
            return
        slopes = alibi_slopes(self.n_heads).to(position_ids.device)

        def pre(module, args, kwargs):
            alibi = kwargs.get("alibi")
            if alibi is None:
                return None
            ids = position_ids[:, -alibi.shape[-1]:].to(alibi.dtype)
            new = (slopes[None, :, None] * ids[:, None, :]).reshape(alibi.shape)
            return args, {**kwargs, "alibi": new}

        handles = [b.attn.register_forward_pre_hook(pre, with_kwargs=True) for b in self.model.blocks]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def forward(self, tokens, mask, position_ids=None, fwd_hooks=()):
        with self._alibi_positions(position_ids), self.model.hooks(fwd_hooks=list(fwd_hooks)):
            return self.model(tokens, **self._kwargs(mask, position_ids))

    def run_with_cache(self, tokens, mask, position_ids=None):
        with self._alibi_positions(position_ids), self.capture_position_ids() as seen:
            logits, cache = self.model.run_with_cache(tokens, names_filter=audited_hook,
                                                      **self._kwargs(mask, position_ids))
        return logits, cache, (seen[0] if seen else None)

    @contextlib.contextmanager
    def capture_position_ids(self) -> Iterator[list]:
        """Record the position ids the HF model used, read back from its own position evidence.

        GPT-2: the ids entering the position table (``pos_embed.hook_in``). RoPE models: decoded
        from the cos/sin the rotary embedding computed (``blocks.0.attn.hook_cos|hook_sin``).
        Bloom: read from the ALiBi tensor slope_h * p_j handed to block 0.
        """
        seen: list[Tensor] = []
        bridge = self.model
        if self._is_bloom:
            slope = float(alibi_slopes(self.n_heads)[0])

            def pre(module, args, kwargs):
                alibi = kwargs.get("alibi")
                if alibi is not None:
                    batch = alibi.shape[0] // self.n_heads
                    keys = alibi.reshape(batch, self.n_heads, -1)[:, 0] / slope
                    n_new = (args[0] if args else kwargs["hidden_states"]).shape[1]
                    seen.append(as_ids(keys[:, -n_new:]))

            handle = bridge.blocks[0].attn.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                yield seen
            finally:
                handle.remove()
            return
        if self.input_method is not None:
            def hook(x, hook):
                seen.append(x.detach().clone())
            with bridge.hooks(fwd_hooks=[("pos_embed.hook_in", hook)]):
                yield seen
            return
        store: dict[str, Tensor] = {}

        def keep(x, hook):
            store[hook.name.rsplit(".", 1)[-1]] = x.detach().clone()
            if len(store) == 2:
                seen.append(self._decode_rope_ids(store.pop("hook_cos"), store.pop("hook_sin")))

        with bridge.hooks(fwd_hooks=[("blocks.0.attn.hook_cos", keep), ("blocks.0.attn.hook_sin", keep)]):
            yield seen

    def _decode_rope_ids(self, cos: Tensor, sin: Tensor) -> Tensor:
        """Integer positions p whose reference angles p * theta_r best match HF's cos/sin."""
        half, device = self.rope.rotary_dim // 2, cos.device
        cos, sin = cos[..., :half].double().cpu(), sin[..., :half].double().cpu()
        candidates = torch.arange(self.position_limit)
        angles = rope_angles(candidates, self.rope.rotary_dim, self.rope.base, dtype=torch.float64)
        ref_cos, ref_sin = angles.cos(), angles.sin()
        best, worst = [], 0.0
        for start in range(0, cos.shape[-2], 32):  # chunks bound the [pos, candidate, half] tensor
            c, s = cos[..., start:start + 32, None, :], sin[..., start:start + 32, None, :]
            err = (c - ref_cos).abs().sum(-1) + (s - ref_sin).abs().sum(-1)
            best.append(err.argmin(-1))
            worst = max(worst, float(err.min(-1).values.max()))
        ids = torch.cat(best, -1)
        if worst > 1e-3 * half:  # not angles p * theta_r for any p < position_limit
            ids = torch.full_like(ids, -1)
        return ids.to(device)

    def decode_incrementally(self, tokens, mask, split):
        pieces = []
        with self.capture_position_ids() as seen, warnings.catch_warnings():
            # The bridge hands HF its cache as past_key_values, which transformers 5 deprecates.
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            logits, past = self.model(tokens[:, :split], attention_mask=mask[:, :split],
                                      return_type="logits_and_cache", use_cache=True)
            pieces.append(logits)
            for t in range(split, tokens.shape[1]):
                logits, past = self.model(tokens[:, t:t + 1], attention_mask=mask[:, :t + 1],
                                          past_key_values=past, return_type="logits_and_cache", use_cache=True)
                pieces.append(logits)
        ids = torch.cat([s.expand(tokens.shape[0], -1) for s in seen], 1) if len(seen) == len(pieces) else None
        return torch.cat(pieces, 1), {"step_ids": ids, "cache_ids": None}

    def forward_without_bias(self, tokens, mask, fwd_hooks):
        """Bloom: zero position ids make its ALiBi tensor zero; other families cannot drop a bias."""
        if not self._is_bloom:
            return False
        self.forward(tokens, mask, torch.zeros_like(tokens), fwd_hooks)
        return True

    def attention(self, layer: int):
        raise TypeError("the audit reads no position table of an HF model")

    def input_reference(self, position_ids: Tensor, width: int) -> Tensor:
        """The learned position table's rows at the ids, float64."""
        return _learned_table(self.model.original_model).double()[position_ids]

    def score_scale(self, layer: int) -> float:
        scale = self.d_head ** -0.5
        if getattr(self.config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer + 1
        return scale



def _learned_table(hf) -> Tensor:
    for name in ("transformer.wpe", "model.decoder.embed_positions", "transformer.wpe.original_component"):
        module = hf.get_submodule(name) if _has_submodule(hf, name) else None
        if module is not None and hasattr(module, "weight"):
            return module.weight
    embeddings = hf.get_position_embeddings() if hasattr(hf, "get_position_embeddings") else None
    if embeddings is None:
        raise ValueError(f"cannot find the learned position table of {type(hf).__name__}")
    return embeddings.weight


def _has_submodule(module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False
