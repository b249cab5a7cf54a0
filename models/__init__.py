"""Small hooked decoders and everything needed to make them."""

from .config import ATTENTION_METHODS, INPUT_METHODS, POSITION_METHODS, DecoderConfig
from .decoder import Decoder, KVCache

__all__ = ["ATTENTION_METHODS", "INPUT_METHODS", "POSITION_METHODS", "Decoder", "DecoderConfig", "KVCache"]
