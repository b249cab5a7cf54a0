"""Small hooked decoders and everything needed to make them."""

from .config import ATTENTION_METHODS, INPUT_METHODS, POSITION_METHODS, DecoderConfig
from .convert import decoder_from_gpt2
from .decoder import Decoder
from .kv_cache import KVCache

__all__ = [
    "ATTENTION_METHODS",
    "INPUT_METHODS",
    "POSITION_METHODS",
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "decoder_from_gpt2",
]
