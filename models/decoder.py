"""The hooked decoder: a small pre-norm transformer whose only varying part is the position method.

``Decoder`` is a TransformerLens ``HookedRootModule``, so ``run_with_cache``, ``hooks()``,
``run_with_hooks`` and ``names_filter`` work as TransformerLens users expect, and TransformerLens'
own tools (``transformer_lens.patching``, ``head_detector``, the ``ActivationCache`` methods) run on
it; what they need beyond ``HookedRootModule`` lives in :mod:`nopelens.models.tl_compat`. Hook and weight names
follow TransformerLens (``blocks.{l}.attn.hook_pattern``, ``W_Q [n_heads, d_model, d_head]``).
Content scores and position contributions are hooked separately (seed
``002_c993a97fc3f160f5.txt``, audit step 6):

- ``attn.hook_content_scores`` q.k times ``cfg.content_scale`` (1 / sqrt(d_head) unless ``score_scale``
  says otherwise; for RoPE, of the rotated q and k)
- ``attn.hook_pos_bias`` the score a method adds: ALiBi's -m_h (i - j), Shaw's q.a^K / sqrt(d_head)
- ``attn.hook_attn_scores`` their sum, with -inf at blocked entries (as in TransformerLens)
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from . import generation, tl_compat
from .config import DecoderConfig
from .kv_cache import KVCache
from .masks import check_rows_have_a_key, visibility
from .methods import QK_ROTATION, SCORE_BIAS, PositionMethod, get_method
from .methods.learned import PosEmbed  # noqa: F401  (its home before the method modules)
from .positions import position_ids_from_mask

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class Norm(nn.Module):
    """LayerNorm, RMSNorm or identity, with ``hook_scale`` and ``hook_normalized``.

    As in TransformerLens' ``LayerNorm``/``RMSNorm``: ``hook_scale`` ``[batch, pos, 1]`` is
    sqrt(mean(x_c^2) + eps) with x_c = x - mean(x) for LayerNorm and x_c = x for RMSNorm, and
    ``hook_normalized`` is x_c / scale before the weight w and bias b. TransformerLens'
    ``ActivationCache.apply_ln_to_stack`` divides a stack by this cached scale.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.kind, self.eps = cfg.normalization, cfg.layer_norm_eps
        if self.kind != "none":
            self.w = nn.Parameter(torch.ones(cfg.d_model))
        if self.kind == "layernorm" and cfg.use_bias:
            self.b = nn.Parameter(torch.zeros(cfg.d_model))
        self.hook_scale = HookPoint()  # [batch, pos, 1]
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.kind == "none":
            return self.hook_normalized(x)
        if not (_is_hooked(self.hook_scale) or _is_hooked(self.hook_normalized)):
            return self._fused(x)
        if self.kind == "layernorm":
            x = x - x.mean(-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        x = self.hook_normalized(x / scale) * self.w
        return x + self.b if hasattr(self, "b") else x

    def _fused(self, x: Tensor) -> Tensor:
        """The same function in one kernel, for when no hook needs the scale or normalized x."""
        if self.kind == "layernorm":
            return F.layer_norm(x, self.w.shape, self.w, getattr(self, "b", None), self.eps)
        return F.rms_norm(x, self.w.shape, self.w, self.eps)


class Attention(nn.Module):
    """Causal multi-head attention with one position method (a :class:`PositionMethod`).

    Scores are e_ij = q_i.k_j / sqrt(d_head) + bias_ij with blocked entries at -inf (seed 000).
    The method rotates q and k (RoPE, Su et al. 2021), adds a score bias (ALiBi's -m_h (i - j),
    Press et al. 2022; Shaw's q_i.a^K_{clip(j-i)} / sqrt(d_head), Shaw et al. 2018; T5's bucketed
    bias, Raffel et al. 2020) and/or a value term (Shaw's a^V), as it declares.

    Args:
        cfg: the configuration.
        method: a method object or its config name (``nope``, ``rope``, ...).
    """

    def __init__(self, cfg: DecoderConfig, method: PositionMethod | str):
        super().__init__()
        self.cfg = cfg
        self.position_method = get_method(method) if isinstance(method, str) else method
        h, d, e = cfg.n_heads, cfg.d_model, cfg.d_head
        self.W_Q = nn.Parameter(torch.empty(h, d, e))
        self.W_K = nn.Parameter(torch.empty(h, d, e))
        self.W_V = nn.Parameter(torch.empty(h, d, e))
        self.W_O = nn.Parameter(torch.empty(h, e, d))
        if cfg.use_bias:
            self.b_Q = nn.Parameter(torch.zeros(h, e))
            self.b_K = nn.Parameter(torch.zeros(h, e))
            self.b_V = nn.Parameter(torch.zeros(h, e))
            self.b_O = nn.Parameter(torch.zeros(d))
        self.position_method.add_parameters(self, cfg)
        self.hook_q = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        if self.position_method.acts(QK_ROTATION):
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_content_scores = HookPoint()  # [batch, head_index, query_pos, key_pos]
        if self.position_method.acts(SCORE_BIAS):
            self.hook_pos_bias = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, head_index, d_head]
        self.hook_result = HookPoint()  # [batch, pos, head_index, d_model], when cfg.use_attn_result
        self.use_fused = True

    @property
    def method(self) -> str:
        """The config name of the layer's position method."""
        return self.position_method.name

    def _project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[batch, pos, head_index, d_head]`` from one matmul with W_Q, W_K, W_V side by side."""
        h, e = self.cfg.n_heads, self.cfg.d_head
        W = torch.cat([self.W_Q, self.W_K, self.W_V]).transpose(1, 2).reshape(3 * h * e, -1)
        b = torch.cat([self.b_Q, self.b_K, self.b_V]).flatten() if hasattr(self, "b_Q") else None
        return F.linear(x, W, b).unflatten(-1, (3 * h, e)).split(h, dim=2)

    def _needs_pattern(self) -> bool:
        """The explicit path runs when anyone hooks a score or pattern, or the method needs it."""
        if not self.use_fused or self.position_method.needs_explicit_scores(self):
            return True
        names = ("hook_content_scores", "hook_pos_bias", "hook_attn_scores", "hook_pattern")
        return any(_is_hooked(getattr(self, name, None)) for name in names)

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        key_positions: Int[Tensor, "batch key_pos"],
        allowed: Bool[Tensor, "batch 1 pos key_pos"],
        past: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Float[Tensor, "batch pos d_model"], tuple[Tensor, Tensor]]:
        """Attend from the rows of ``x`` to the cached keys plus the rows of ``x``.

        Returns:
            The attention output and the new (unrotated) keys and values to cache.
        """
        q, k_new, v_new = self._project_qkv(x)
        q, k_new, v_new = self.hook_q(q), self.hook_k(k_new), self.hook_v(v_new)
        k, v = k_new, v_new
        if past is not None:
            k, v = torch.cat([past[0], k_new], dim=1), torch.cat([past[1], v_new], dim=1)
        query_positions = key_positions[:, -x.shape[1] :]
        method = self.position_method
        if method.acts(QK_ROTATION):
            q = self.hook_rot_q(method.rotate(self, q, query_positions))
            k = self.hook_rot_k(method.rotate(self, k, key_positions))
        if self._needs_pattern():
            z = self._explicit(q, k, v, query_positions, key_positions, allowed)
        else:
            z = self._fused(q, k, v, query_positions, key_positions, allowed)
        z = self.hook_z(z)
        if self.cfg.use_attn_result:
            out = self.hook_result(torch.einsum("bqhe,hed->bqhd", z, self.W_O)).sum(-2)
            return (out + self.b_O if hasattr(self, "b_O") else out), (k_new, v_new)
        out = F.linear(z.flatten(-2), self.W_O.flatten(0, 1).T, getattr(self, "b_O", None))
        return out, (k_new, v_new)

    def _explicit(self, q, k, v, query_positions, key_positions, allowed) -> Tensor:
        content, scale = torch.einsum("bqhe,bkhe->bhqk", q, k), self.cfg.score_scale
        # the default divides by sqrt(d_head), as it always did: its numbers stay the same to the last bit
        scores = self.hook_content_scores(content / math.sqrt(self.cfg.d_head) if scale is None else content * scale)
        bias = self.position_method.score_bias(self, q, query_positions, key_positions)
        if bias is not None:
            scores = scores + self.hook_pos_bias(bias)
        scores = self.hook_attn_scores(scores.masked_fill(~allowed, float("-inf")))
        pattern = self.hook_pattern(scores.softmax(dim=-1))
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
        value_term = self.position_method.value_term(self, pattern, query_positions, key_positions)
        return z if value_term is None else z + value_term

    def _fused(self, q, k, v, query_positions, key_positions, allowed) -> Tensor:
        """``scaled_dot_product_attention``: the same function, without materializing hooks."""
        bias = self.position_method.score_bias(self, q, query_positions, key_positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scale = self.cfg.score_scale  # None: the kernel's own 1 / sqrt(d_head)
        n_query, n_key = q.shape[2], k.shape[2]
        # allowed is a subset of the causal mask; it is exactly causal iff it has all its entries
        # (a batch-1 input with left padding also has allowed.shape[0] == 1, but fewer entries)
        plain_causal = (
            bias is None
            and allowed.shape[0] == 1
            and n_query == n_key
            and int(allowed.sum()) == n_query * (n_query + 1) // 2
        )
        if plain_causal:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        elif bias is None:
            z = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        else:
            z = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.masked_fill(~allowed, float("-inf")), scale=scale
            )
        return z.transpose(1, 2)


class MLP(nn.Module):
    """Two-layer MLP: W_out act(W_in x + b_in) + b_out, hooked at ``hook_pre`` and ``hook_post``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.W_in = nn.Parameter(torch.empty(cfg.d_model, cfg.d_mlp))
        self.W_out = nn.Parameter(torch.empty(cfg.d_mlp, cfg.d_model))
        if cfg.use_bias:
            self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp))
            self.b_out = nn.Parameter(torch.zeros(cfg.d_model))
        self.act = _ACTIVATIONS[cfg.act_fn]
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        self.hook_post = HookPoint()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        pre = F.linear(x, self.W_in.T, getattr(self, "b_in", None))
        post = self.hook_post(self.act(self.hook_pre(pre)))
        return F.linear(post, self.W_out.T, getattr(self, "b_out", None))


class Block(nn.Module):
    """Pre-norm block: resid_mid = resid_pre + attn(ln1(resid_pre)); resid_post = resid_mid + mlp(ln2(resid_mid))."""

    hook_out_is_single_residual_stream = True  # TransformerLens' logit_lens asks before reading resid_post

    def __init__(self, cfg: DecoderConfig, method: PositionMethod | str):
        super().__init__()
        self.ln1 = Norm(cfg)
        self.attn = Attention(cfg, method)
        self.has_mlp = cfg.d_mlp > 0
        if self.has_mlp:
            self.ln2 = Norm(cfg)
            self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, resid, key_positions, allowed, past=None):
        resid = self.hook_resid_pre(resid)
        attn_out, new_kv = self.attn(self.ln1(resid), key_positions, allowed, past)
        resid = self.hook_resid_mid(resid + self.hook_attn_out(attn_out))
        if self.has_mlp:
            resid = resid + self.hook_mlp_out(self.mlp(self.ln2(resid)))
        return self.hook_resid_post(resid), new_kv


class Embed(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))


class Unembed(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        if cfg.use_bias:
            self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return F.linear(x, self.W_U.T, getattr(self, "b_U", None))


class Decoder(tl_compat.TransformerLensCompat):
    """Decoder-only transformer with one configurable position method, hooked TransformerLens-style.

    Args:
        cfg: the configuration.
        seed: if given, weights are initialized from a private generator seeded with it, so the
            same seed gives the same weights whatever the global RNG state.
        device: where to put the parameters.
        dtype: parameter dtype (position angles and tables are computed in float32 or wider).

    Hook points (shapes as TransformerLens names them): ``hook_embed`` and ``hook_pos_embed``
    ``[batch, pos, d_model]``; ``blocks.{l}.hook_resid_pre|hook_attn_out|hook_resid_mid|
    hook_mlp_out|hook_resid_post`` ``[batch, pos, d_model]``; ``blocks.{l}.attn.hook_q|hook_k|hook_v|
    hook_rot_q|hook_rot_k|hook_z`` ``[batch, pos, head_index, d_head]``; ``blocks.{l}.attn.
    hook_content_scores|hook_pos_bias|hook_attn_scores|hook_pattern`` ``[batch, head_index,
    query_pos, key_pos]``; ``ln_final.hook_normalized``.

    ``model.cfg`` is the model's own copy of ``cfg`` (equal to it), whose ``device``, ``dtype`` and
    ``use_attn_result`` follow the model, as TransformerLens' tools read them.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        seed: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        cfg = self.cfg = copy.copy(cfg)  # its own: .to() and set_use_attn_result update it
        cfg._set_runtime(use_attn_result=False)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"dtype must be a real floating torch.dtype such as torch.float32 or torch.bfloat16, got {dtype!r}"
            )
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        self.input_method = cfg.input_method
        if self.input_method is not None:
            self.input_method.add_input_parameters(self, cfg)
            self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList(Block(cfg, m) for m in cfg.layer_methods)
        for method in dict.fromkeys(cfg.layer_methods):
            method.share_parameters(self, cfg)
        self.ln_final = Norm(cfg)
        self.unembed = Unembed(cfg)
        self.tokenizer = None  # set_tokenizer(); byte-level text models carry a ByteTokenizer
        self.init_weights(seed)
        self.to(device=device, dtype=dtype)
        self.setup()

    # ----------------------------------------------------------------------------- weights
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, init_std) weight matrices and tables, zero biases, unit norm weights."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for name, param in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.startswith("W_"):
                    cpu = torch.empty(param.shape).normal_(0.0, self.cfg.init_std, generator=generator)
                    param.copy_(cpu)
                elif leaf == "w":
                    param.fill_(1.0)
                else:
                    param.zero_()

    @property
    def device(self) -> torch.device:
        return self.embed.W_E.device

    def set_fused_attention(self, enabled: bool) -> None:
        """Allow (default) or forbid ``scaled_dot_product_attention`` when no one hooks a pattern."""
        for block in self.blocks:
            block.attn.use_fused = enabled

    # ----------------------------------------------------------------------------- forward
    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        position_ids: Int[Tensor, "batch pos"] | None = None,
        stop_at_layer: int | None = None,
        past_kv: KVCache | None = None,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
    ):
        """Run the model.

        Args:
            tokens: int64 token ids in ``[0, d_vocab)``.
            attention_mask: 1 for real tokens, 0 for padding (left or right), over the new tokens
                only when ``past_kv`` is given. Default: all real.
            position_ids: explicit int64 position ids (for interventions). Default: counted from
                the attention mask, so the first real token of each row is at position 0 (or at the
                cache's next position).
            stop_at_layer: if given, run blocks ``0 .. stop_at_layer - 1`` and return the residual
                stream ``[batch, pos, d_model]`` (0 returns the embeddings plus input positions).
                A negative ``k`` counts from the end, ``n_layers + k``, as TransformerLens'
                ``HookedTransformer.forward`` documents (``-1`` skips the last block).
            past_kv: a :class:`KVCache`; the new keys and values are appended to it (only once the
                pass has succeeded).
            return_type: as in TransformerLens: ``"logits"``, ``"loss"`` (next-token cross
                entropy of ``tokens``, over pairs of real tokens; see
                :func:`~nopelens.models.tl_compat.lm_output`), ``"both"`` (``(logits, loss)``) or
                None (run for the hooks, return nothing).
            loss_per_token: the loss per position ``[batch, pos - 1]`` instead of its mean.

        Returns:
            Logits ``[batch, pos, d_vocab]`` (or the loss, as ``return_type`` says), or the residual
            stream ``[batch, pos, d_model]`` when ``stop_at_layer`` is set.

        Raises:
            TypeError: if tokens, mask or position ids are not integer tensors.
            ValueError: on a token id outside the vocabulary, a wrong shape, a mask that is not
                0/1, a fully masked row, a negative position, a position past a learned table's
                ``n_ctx`` rows, ``stop_at_layer`` outside ``[-n_layers, n_layers]`` or with a cache or a
                loss, an unknown ``return_type``, or a loss with no two consecutive real tokens.
        """
        tl_compat.check_return_type(return_type, loss_per_token, stop_at_layer)
        self._check_tokens(tokens)
        batch, n_new = tokens.shape
        if past_kv is None:
            past_mask = tokens.new_zeros(batch, 0)
            past_positions = tokens.new_zeros(batch, 0)
        else:
            if stop_at_layer is not None:
                raise ValueError("stop_at_layer cannot be combined with past_kv")
            if not isinstance(past_kv, KVCache):
                raise TypeError(f"past_kv must be a KVCache (KVCache.empty(cfg, batch)), got {type(past_kv).__name__}")
            if len(past_kv.keys) != self.cfg.n_layers:
                raise ValueError(f"past_kv holds {len(past_kv.keys)} layers, this model has {self.cfg.n_layers}")
            if past_kv.position_ids.shape[0] != batch:
                raise ValueError(f"past_kv holds batch {past_kv.position_ids.shape[0]}, tokens have {batch}")
            past_mask, past_positions = past_kv.attention_mask, past_kv.position_ids
        attention_mask = self._check_mask(attention_mask, tokens)
        if position_ids is None:
            start = past_kv.next_position if past_kv is not None else None
            position_ids = position_ids_from_mask(attention_mask, start)
        self._check_position_ids(position_ids, tokens)
        key_mask = torch.cat([past_mask, attention_mask], dim=1)
        key_positions = torch.cat([past_positions, position_ids], dim=1)
        has_padding = not bool(key_mask.all())
        allowed = visibility(key_mask if has_padding else None, n_new, key_mask.shape[1], tokens.device)
        if has_padding:
            check_rows_have_a_key(allowed)

        resid = self._embed(tokens, position_ids)
        n_blocks = self.cfg.n_layers if stop_at_layer is None else self._check_stop(stop_at_layer)
        new_kv = []
        for layer, block in enumerate(self.blocks[:n_blocks]):
            past = None
            if past_kv is not None and past_kv.keys[layer] is not None:
                past = (past_kv.keys[layer], past_kv.values[layer])
            resid, kv = block(resid, key_positions, allowed, past)
            new_kv.append(kv)
        if stop_at_layer is not None:
            return resid
        logits = self.unembed(self.ln_final(resid))
        output = tl_compat.lm_output(logits, tokens, attention_mask, return_type, loss_per_token)
        if past_kv is not None:
            self._append_to_cache(past_kv, new_kv, position_ids, attention_mask)
        return output

    def _embed(self, tokens: Tensor, position_ids: Tensor) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_embed(F.embedding(tokens, self.embed.W_E))
        if self.input_method is not None:
            resid = resid + self.hook_pos_embed(self.input_method.input_vectors(self, position_ids, resid.dtype))
        return resid

    @staticmethod
    def _append_to_cache(cache: KVCache, new_kv, position_ids, attention_mask) -> None:
        for layer, (k, v) in enumerate(new_kv):
            old_k, old_v = cache.keys[layer], cache.values[layer]
            cache.keys[layer] = k if old_k is None else torch.cat([old_k, k], dim=1)
            cache.values[layer] = v if old_v is None else torch.cat([old_v, v], dim=1)
        cache.position_ids = torch.cat([cache.position_ids, position_ids], dim=1)
        cache.attention_mask = torch.cat([cache.attention_mask, attention_mask], dim=1)

    # ----------------------------------------------------------------------------- validation
    def _check_tokens(self, tokens: Tensor) -> None:
        if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor [batch, pos], got {_describe(tokens)}")
        if tokens.ndim != 2 or 0 in tokens.shape:
            raise ValueError(
                f"tokens must have shape [batch, pos] with batch >= 1 and pos >= 1, got {tuple(tokens.shape)}"
            )
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.cfg.d_vocab:
            bad = low if low < 0 else high
            where = (tokens == bad).nonzero()[0].tolist()
            raise ValueError(
                f"token id {bad} at (batch {where[0]}, position {where[1]}) is outside the "
                f"vocabulary [0, {self.cfg.d_vocab})"
            )

    @staticmethod
    def _check_mask(mask: Tensor | None, tokens: Tensor) -> Tensor:
        if mask is None:
            return torch.ones_like(tokens, dtype=torch.long)
        if not isinstance(mask, Tensor) or mask.dtype.is_floating_point:
            raise TypeError(f"attention_mask must be an integer or bool tensor, got {_describe(mask)}")
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} != tokens shape {tuple(tokens.shape)}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (real token)")
        return mask.long()

    def _check_position_ids(self, position_ids: Tensor, tokens: Tensor) -> None:
        if not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point:
            raise TypeError(f"position_ids must be an int64 tensor, got {_describe(position_ids)}")
        if position_ids.shape != tokens.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != tokens shape {tuple(tokens.shape)}")
        if int(position_ids.min()) < 0:
            raise ValueError(f"position ids must be >= 0, got {int(position_ids.min())}")
        limit = self.cfg.max_positions
        if limit is not None and int(position_ids.max()) >= limit:
            raise ValueError(
                f"position {int(position_ids.max())} is past the learned position table, which has "
                f"n_ctx={limit} rows; a learned table has no row to look up (no wrapping)"
            )

    def _check_stop(self, stop_at_layer: int) -> int:
        """The number of blocks to run: ``stop_at_layer``, or ``n_layers + stop_at_layer`` when negative."""
        n_layers = self.cfg.n_layers
        if not -n_layers <= stop_at_layer <= n_layers:
            raise ValueError(
                f"stop_at_layer must lie in [-{n_layers}, {n_layers}] (negative: n_layers + k, "
                f"as in TransformerLens), got {stop_at_layer}"
            )
        return stop_at_layer if stop_at_layer >= 0 else n_layers + stop_at_layer

    # ----------------------------------------------------------------------------- weights, stacked
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        """The unembedding bias (zeros when ``use_bias`` is off)."""
        bias = getattr(self.unembed, "b_U", None)
        return bias if bias is not None else self.W_U.new_zeros(self.cfg.d_vocab)

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return torch.stack([block.attn.W_Q for block in self.blocks])

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return torch.stack([block.attn.W_K for block in self.blocks])

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return torch.stack([block.attn.W_V for block in self.blocks])

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head d_model"]:
        return torch.stack([block.attn.W_O for block in self.blocks])

    @property
    def b_O(self) -> Float[Tensor, "n_layers d_model"]:
        """Attention output biases (zeros when ``use_bias`` is off)."""
        return torch.stack([getattr(b.attn, "b_O", torch.zeros_like(self.W_U[:, 0])) for b in self.blocks])

    # ----------------------------------------------------------------------------- text
    def set_tokenizer(self, tokenizer) -> None:
        """Give the model a tokenizer (a :class:`~nopelens.models.tasks.ByteTokenizer`), or None.

        Raises:
            ValueError: if the tokenizer's ids do not fit in ``d_vocab``.
        """
        if tokenizer is not None and tokenizer.d_vocab > self.cfg.d_vocab:
            raise ValueError(
                f"{tokenizer!r} uses ids up to {tokenizer.d_vocab - 1}, but this model's "
                f"vocabulary is [0, {self.cfg.d_vocab})"
            )
        self.tokenizer = tokenizer

    def to_tokens(self, input, prepend_bos=None, padding_side="right", move_to_device=True, truncate=False):
        """Token ids ``[batch, pos]`` of a string or a list of strings; see
        :func:`~nopelens.models.generation.to_tokens`."""
        return generation.to_tokens(self, input, prepend_bos, padding_side, move_to_device, truncate)

    def to_string(self, tokens):
        """Text of ``[pos]`` (a str) or ``[batch, pos]`` (a list) ids; see
        :func:`~nopelens.models.generation.to_string`."""
        return generation.to_string(self, tokens)

    def to_str_tokens(self, input, prepend_bos=None):
        """Each token of one sequence as a string; see :func:`~nopelens.models.generation.to_str_tokens`."""
        return generation.to_str_tokens(self, input, prepend_bos)

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token (one byte for byte-level models).

        Raises:
            ValueError: if ``string`` is not exactly one token.
        """
        tokens = self.to_tokens(string, prepend_bos=False)
        if tokens.numel() != 1:
            raise ValueError(f"{string!r} is {tokens.numel()} tokens, not a single token")
        return int(tokens.item())

    def generate(self, input="", max_new_tokens=10, *args, **kwargs):
        """Continue a prompt, greedy or sampled, with or without the KV cache (the arguments of
        TransformerLens' ``TransformerBridge.generate``, in its order); see
        :func:`~nopelens.models.generation.generate` for every argument."""
        return generation.generate(self, input, max_new_tokens, *args, **kwargs)


def _is_hooked(hook: HookPoint | None) -> bool:
    """Whether a hook point exists and has a forward or backward hook attached."""
    return hook is not None and bool(hook._forward_hooks or hook._backward_hooks)


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__
