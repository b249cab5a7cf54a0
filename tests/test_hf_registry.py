"""The HF family registry: a family is one module of ``nopelens.models.hf.families`` (found without
being listed anywhere) or one :func:`nopelens.models.hf.register` call, and the description uses it."""

from __future__ import annotations

import sys
import textwrap

import pytest
from transformers import LlamaConfig

from nopelens.models import hf
from nopelens.models.hf import family as registry
from nopelens.models.hf import families


class ToyConfig(LlamaConfig):
    model_type = "toy_nope_llama"


def _toy_config():
    return ToyConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=32)


def test_a_family_module_dropped_into_the_families_package_is_discovered(tmp_path, monkeypatch):
    assert hf.describe_config(_toy_config()).layer_methods == ("rope", "rope")  # nothing declared: the config's RoPE
    (tmp_path / "toy_nope_llama.py").write_text(textwrap.dedent("""
        from nopelens.models.hf.family import Family
        FAMILIES = (Family(("toy_nope_llama",), method="nope", position_offset=3),)
    """))
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_discovered", set(registry._discovered))
    name = f"{registry.FAMILIES_PACKAGE}.toy_nope_llama"
    try:
        description = hf.describe_config(_toy_config())
        assert description.layer_methods == ("nope", "nope") and description.position_offset == 3
        assert registry.declared()["toy_nope_llama"] == name
    finally:
        registry.unregister(registry.family_of("toy_nope_llama"))
        sys.modules.pop(name, None)
    assert hf.describe_config(_toy_config()).layer_methods == ("rope", "rope")


def test_register_adds_a_family_and_refuses_a_model_type_declared_twice():
    toy = hf.register(hf.Family(("toy_nope_llama",), method=lambda config, layer: "nope" if layer else None))
    try:
        assert hf.describe_config(_toy_config()).layer_methods == ("rope", "nope")
        with pytest.raises(ValueError, match="'toy_nope_llama' is already declared by register()"):
            hf.register(hf.Family(("toy_nope_llama",)))
        with pytest.raises(ValueError, match=r"'gpt2' is already declared by nopelens\.models\.hf\.families\.learned"):
            hf.register(hf.Family(("gpt2",)))
    finally:
        hf.unregister(toy)
    assert registry.family_of("toy_nope_llama") is registry.DEFAULT
