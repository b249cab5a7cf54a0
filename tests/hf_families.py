"""Tiny random-init HF causal LMs of every common decoder family, built offline from configs.

Shared by the family tests. Sizes are the smallest that keep each family's position mechanics
visible: d_model 32, 4 heads (d_head 8), 2 layers (4 for the per-layer hybrids, so SmolLM3 and
Llama 4 get ``no_rope_layers = [1, 1, 1, 0]`` as shipped), 64 tokens, 64 positions.
"""

from __future__ import annotations

import warnings

import torch
import transformers as T

D, HEADS, LAYERS, VOCAB, POSITIONS = 32, 4, 2, 64, 64
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama_like(cls_config, **extra):
    return cls_config(hidden_size=D, num_hidden_layers=extra.pop("layers", LAYERS), num_attention_heads=HEADS,
                      intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                      **{"num_key_value_heads": 2, **SPECIAL, **extra})


FAMILIES = {
    "gpt2": lambda: (T.GPT2Config(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS,
                                  bos_token_id=1, eos_token_id=2), T.GPT2LMHeadModel),
    "gpt_neox": lambda: (T.GPTNeoXConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                                         rotary_pct=1.0, **SPECIAL), T.GPTNeoXForCausalLM),
    "gpt_neox_rotary_pct_0.25": lambda: (T.GPTNeoXConfig(
        hidden_size=2 * D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=POSITIONS, rotary_pct=0.25, **SPECIAL), T.GPTNeoXForCausalLM),
    "llama": lambda: (_llama_like(T.LlamaConfig), T.LlamaForCausalLM),
    "mistral": lambda: (_llama_like(T.MistralConfig, head_dim=8), T.MistralForCausalLM),
    "mixtral": lambda: (_llama_like(T.MixtralConfig, head_dim=8, num_local_experts=2, num_experts_per_tok=1),
                        T.MixtralForCausalLM),
    "qwen2": lambda: (_llama_like(T.Qwen2Config), T.Qwen2ForCausalLM),
    "qwen3": lambda: (_llama_like(T.Qwen3Config, head_dim=8), T.Qwen3ForCausalLM),
    "phi": lambda: (_llama_like(T.PhiConfig, num_key_value_heads=HEADS, partial_rotary_factor=0.5), T.PhiForCausalLM),
    "phi3": lambda: (_llama_like(T.Phi3Config, num_key_value_heads=HEADS, original_max_position_embeddings=POSITIONS),
                     T.Phi3ForCausalLM),
    "gptj": lambda: (T.GPTJConfig(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=POSITIONS,
                                  rotary_dim=4, bos_token_id=1, eos_token_id=2), T.GPTJForCausalLM),
    "gpt_neo": lambda: (T.GPTNeoConfig(hidden_size=D, num_layers=LAYERS, num_heads=HEADS, vocab_size=VOCAB,
                                       max_position_embeddings=POSITIONS, attention_types=[[["global", "local"], 1]],
                                       window_size=POSITIONS, bos_token_id=1, eos_token_id=2), T.GPTNeoForCausalLM),
    "opt": lambda: (T.OPTConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=64,
                                vocab_size=VOCAB, max_position_embeddings=POSITIONS, word_embed_proj_dim=D, **SPECIAL),
                    T.OPTForCausalLM),
    "falcon_alibi": lambda: (T.FalconConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                            vocab_size=VOCAB, alibi=True, new_decoder_architecture=False,
                                            multi_query=False, parallel_attn=True, bias=False, bos_token_id=1,
                                            eos_token_id=2), T.FalconForCausalLM),
    "falcon_rotary": lambda: (T.FalconConfig(hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                             vocab_size=VOCAB, alibi=False, new_decoder_architecture=False,
                                             multi_query=True, parallel_attn=True, bias=False, bos_token_id=1,
                                             eos_token_id=2), T.FalconForCausalLM),
    "falcon_new_architecture": lambda: (T.FalconConfig(
        hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_kv_heads=2, vocab_size=VOCAB,
        alibi=False, new_decoder_architecture=True, bias=False, bos_token_id=1, eos_token_id=2), T.FalconForCausalLM),
    "bloom": lambda: (T.BloomConfig(hidden_size=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, **SPECIAL),
                      T.BloomForCausalLM),
    "gemma": lambda: (_llama_like(T.GemmaConfig, num_key_value_heads=1, head_dim=8), T.GemmaForCausalLM),
    "gemma2": lambda: (_llama_like(T.Gemma2Config, head_dim=8, query_pre_attn_scalar=16, sliding_window=POSITIONS,
                                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0), T.Gemma2ForCausalLM),
    "gemma3": lambda: (_llama_like(T.Gemma3TextConfig, head_dim=8, query_pre_attn_scalar=16, sliding_window=POSITIONS,
                                   layer_types=["sliding_attention", "full_attention"]), T.Gemma3ForCausalLM),
    "stablelm": lambda: (_llama_like(T.StableLmConfig, num_key_value_heads=HEADS, partial_rotary_factor=0.5),
                         T.StableLmForCausalLM),
    "olmo": lambda: (_llama_like(T.OlmoConfig, num_key_value_heads=HEADS), T.OlmoForCausalLM),
    "olmo2": lambda: (_llama_like(T.Olmo2Config, num_key_value_heads=HEADS), T.Olmo2ForCausalLM),
    "mpt": lambda: (T.MptConfig(d_model=D, n_layers=LAYERS, n_heads=HEADS, vocab_size=VOCAB, max_seq_len=POSITIONS,
                                expansion_ratio=2, **SPECIAL), T.MptForCausalLM),
    "codegen": lambda: (T.CodeGenConfig(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                                        n_positions=POSITIONS, n_ctx=POSITIONS, rotary_dim=4, bos_token_id=1,
                                        eos_token_id=2), T.CodeGenForCausalLM),
    "gpt_bigcode": lambda: (T.GPTBigCodeConfig(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                                               n_positions=POSITIONS, multi_query=True, bos_token_id=1,
                                               eos_token_id=2), T.GPTBigCodeForCausalLM),
    "cohere": lambda: (_llama_like(T.CohereConfig, num_key_value_heads=HEADS), T.CohereForCausalLM),
    "cohere2": lambda: (_llama_like(T.Cohere2Config, layers=4, num_key_value_heads=HEADS, sliding_window=POSITIONS),
                        T.Cohere2ForCausalLM),
    "glm": lambda: (_llama_like(T.GlmConfig, head_dim=8, eos_token_id=[2]), T.GlmForCausalLM),
    "granite": lambda: (_llama_like(T.GraniteConfig, num_key_value_heads=HEADS, attention_multiplier=0.25,
                                    embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
                        T.GraniteForCausalLM),
    "smollm3": lambda: (_llama_like(T.SmolLM3Config, layers=4, no_rope_layers=[1, 1, 1, 0]), T.SmolLM3ForCausalLM),
    "xglm": lambda: (T.XGLMConfig(d_model=D, num_layers=LAYERS, attention_heads=HEADS, ffn_dim=64, vocab_size=VOCAB,
                                  max_position_embeddings=POSITIONS, **SPECIAL), T.XGLMForCausalLM),
    "openai_gpt": lambda: (T.OpenAIGPTConfig(n_embd=D, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
                                             n_positions=POSITIONS), T.OpenAIGPTLMHeadModel),
    "starcoder2": lambda: (_llama_like(T.Starcoder2Config), T.Starcoder2ForCausalLM),
    "nemotron": lambda: (_llama_like(T.NemotronConfig, num_key_value_heads=HEADS, partial_rotary_factor=0.5),
                         T.NemotronForCausalLM),
}
if hasattr(T, "Llama4TextConfig"):
    FAMILIES["llama4"] = lambda: (_llama_like(T.Llama4TextConfig, layers=4, head_dim=8, intermediate_size_mlp=64,
                                              num_local_experts=2, no_rope_layers=[1, 1, 1, 0],
                                              attention_chunk_size=POSITIONS), T.Llama4ForCausalLM)


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-init HF model of ``family`` (eager attention, eval mode), config fields overridden."""
    config, cls = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config).eval()
