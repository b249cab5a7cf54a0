"""Load HF model weights into a nopelens :class:`~nopelens.models.Decoder`.

The Decoder is a pre-norm GPT-2-shaped transformer, so a GPT-2 checkpoint maps onto it one weight
at a time. That makes GPT-2 the full-model reference check of seed ``002_c993a97fc3f160f5.txt``
(as minGPT checks its logits against HF GPT-2): same weights, same logits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import hooks
from .config import DecoderConfig
from .decoder import Decoder

# GPT-2's "gelu_new" is the tanh approximation of GELU (Hendrycks & Gimpel 2016, eq. in sec. 2).
_GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def decoder_from_gpt2(hf_model: nn.Module) -> Decoder:
    """A ``Decoder`` with the weights of an HF ``GPT2LMHeadModel``, giving the same logits.

    The Decoder is configured as GPT-2: ``position="learned"`` with ``n_ctx = n_positions``,
    ``act_fn="gelu_tanh"``, LayerNorm with GPT-2's epsilon, biases, and ``d_mlp = n_inner`` (or
    ``4 * d_model``). GPT-2's ``Conv1D`` weights are stored ``[in, out]``, and ``c_attn`` packs Q, K
    and V side by side, so each ``[d_model, d_model]`` slice is split by head into TransformerLens
    shapes: ``W_Q, W_K, W_V [n_heads, d_model, d_head]``, ``W_O [n_heads, d_head, d_model]``. The
    unembedding is ``W_U = lm_head.weight.T`` (GPT-2 ties it to ``wte``); GPT-2 has no unembedding
    bias, so ``b_U`` is zero. The Decoder has the model's dtype and device, and is in eval mode.

    Args:
        hf_model: a ``transformers.GPT2LMHeadModel`` (e.g. ``GPT2LMHeadModel(GPT2Config(...))``).

    Returns:
        A :class:`~nopelens.models.Decoder` whose logits equal ``hf_model(tokens).logits`` (up to
        float rounding) for unpadded input with default positions.

    Raises:
        TypeError: if ``hf_model`` is not a ``GPT2LMHeadModel``.
        ValueError: if its config uses a GPT-2 variant the Decoder does not express (cross
            attention, layer-index score scaling, unscaled scores, a non-tanh activation), or a
            weight has an unexpected shape.
    """
    from transformers import GPT2LMHeadModel  # lazy: 0.3 s at each import of nopelens.models

    if not isinstance(hf_model, GPT2LMHeadModel):
        raise TypeError(f"decoder_from_gpt2 expects a transformers GPT2LMHeadModel, got {type(hf_model).__name__}")
    hf_cfg = hf_model.config
    cfg = _gpt2_config(hf_cfg)
    weight = hf_model.transformer.wte.weight
    decoder = Decoder(cfg, device=weight.device, dtype=weight.dtype)
    state = _gpt2_state_dict(hf_model, cfg)
    expected = decoder.state_dict()
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"GPT-2 weight for {name} has shape {tuple(tensor.shape)}, the Decoder expects "
                f"{tuple(expected[name].shape)}"
            )
    decoder.load_state_dict(state, strict=True)
    return decoder.eval()


def _gpt2_config(hf_cfg) -> DecoderConfig:
    if getattr(hf_cfg, "add_cross_attention", False):
        raise ValueError("GPT-2 config has add_cross_attention=True; the Decoder has no cross attention")
    if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError(
            "GPT-2 config has scale_attn_by_inverse_layer_idx=True; the Decoder scales by 1/sqrt(d_head) only"
        )
    if not getattr(hf_cfg, "scale_attn_weights", True):
        raise ValueError("GPT-2 config has scale_attn_weights=False; the Decoder always scales by 1/sqrt(d_head)")
    if hf_cfg.activation_function not in _GPT2_TANH_GELUS:
        raise ValueError(
            f"GPT-2 config has activation_function={hf_cfg.activation_function!r}; the Decoder's "
            f"gelu_tanh matches {_GPT2_TANH_GELUS}"
        )
    return DecoderConfig(
        d_vocab=hf_cfg.vocab_size,
        n_ctx=hf_cfg.n_positions,
        n_layers=hf_cfg.n_layer,
        d_model=hf_cfg.n_embd,
        n_heads=hf_cfg.n_head,
        d_mlp=hf_cfg.n_inner if hf_cfg.n_inner is not None else 4 * hf_cfg.n_embd,
        act_fn="gelu_tanh",
        normalization="layernorm",
        use_bias=True,
        position="learned",
        layer_norm_eps=hf_cfg.layer_norm_epsilon,
    )


def _gpt2_state_dict(hf_model: nn.Module, cfg: DecoderConfig) -> dict[str, Tensor]:
    """The Decoder's state dict, weight by weight from GPT-2's (Conv1D weights are [in, out])."""
    h, d, e = cfg.n_heads, cfg.d_model, cfg.d_head
    gpt2 = hf_model.transformer
    state = {
        "embed.W_E": gpt2.wte.weight,
        "pos_embed.W_pos": gpt2.wpe.weight,
        "ln_final.w": gpt2.ln_f.weight,
        "ln_final.b": gpt2.ln_f.bias,
        "unembed.W_U": hf_model.lm_head.weight.T,
        "unembed.b_U": torch.zeros(cfg.d_vocab, dtype=gpt2.wte.weight.dtype, device=gpt2.wte.weight.device),
    }
    for layer, block in enumerate(gpt2.h):
        prefix = hooks.block(layer)
        W_qkv, b_qkv = block.attn.c_attn.weight, block.attn.c_attn.bias
        if W_qkv.shape != (d, 3 * d):
            raise ValueError(f"{prefix}: c_attn.weight has shape {tuple(W_qkv.shape)}, expected ({d}, {3 * d})")
        for name, W, b in zip("QKV", W_qkv.split(d, dim=1), b_qkv.split(d, dim=0)):
            state[f"{prefix}.attn.W_{name}"] = W.reshape(d, h, e).permute(1, 0, 2)
            state[f"{prefix}.attn.b_{name}"] = b.reshape(h, e)
        state[f"{prefix}.attn.W_O"] = block.attn.c_proj.weight.reshape(h, e, d)
        state[f"{prefix}.attn.b_O"] = block.attn.c_proj.bias
        state[f"{prefix}.ln1.w"], state[f"{prefix}.ln1.b"] = block.ln_1.weight, block.ln_1.bias
        state[f"{prefix}.ln2.w"], state[f"{prefix}.ln2.b"] = block.ln_2.weight, block.ln_2.bias
        state[f"{prefix}.mlp.W_in"], state[f"{prefix}.mlp.b_in"] = block.mlp.c_fc.weight, block.mlp.c_fc.bias
        state[f"{prefix}.mlp.W_out"], state[f"{prefix}.mlp.b_out"] = block.mlp.c_proj.weight, block.mlp.c_proj.bias
    return {name: tensor.detach().clone() for name, tensor in state.items()}
