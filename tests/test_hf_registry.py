"""The HF family registry: a family is one module of ``nopelens.models.hf.families`` (found without
being listed anywhere) or one :func:`nopelens.models.hf.register` call, and the description uses it."""

from __future__ import annotations

import sys
import textwrap

import pytest
from transformers import LlamaConfig

from nopelens.models import hf
from nopelens.models.hf import families
from nopelens.models.hf import family as registry


class ToyConfig(LlamaConfig):
    model_type = "toy_nope_llama"


def _toy_config():
    return ToyConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=32)


def test_a_family_module_dropped_into_the_families_package_is_discovered(tmp_path, monkeypatch):
    assert hf.describe_config(_toy_config()).layer_methods == ("rope", "rope")  # nothing declared: the config's RoPE
    (tmp_path / "toy_nope_llama.py").write_text(
        textwrap.dedent("""
        from nopelens.models.hf.family import Family
        FAMILIES = (Family(("toy_nope_llama",), method="nope", position_offset=3),)
    """)
    )
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


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(model_types="qwen9"), TypeError, r"model_types='qwen9'\): give a tuple of model_type strings"),
        (dict(model_types=None), TypeError, "model_types=None"),
        (dict(model_types=("ok", "")), TypeError, r"model_types=\('ok', ''\)"),
        (dict(model_types=("toy",), method="spiral"), ValueError, "method='spiral' is none of nope, rope, alibi"),
        (dict(model_types=("toy",), pairing="diagonal"), ValueError, "pairing='diagonal' is none of half, interleaved"),
        (
            dict(model_types=("toy",), sink="weird"),
            ValueError,
            "sink='weird' is none of learned, output_scale, per_token",
        ),
    ],
)
def test_a_family_the_core_cannot_read_is_refused_when_made(fields, error, message):
    with pytest.raises(error, match=message):
        hf.Family(**fields)


def test_the_registry_refuses_what_is_not_a_family_or_a_model_type():
    with pytest.raises(ValueError, match="declares no model_type"):
        hf.register(hf.Family(()))
    with pytest.raises(TypeError, match=r"register needs a Family, got \{'model_types': \('x',\)\} \(a dict\)"):
        hf.register({"model_types": ("x",)})
    with pytest.raises(
        TypeError, match=r"unregister needs a Family \(family_of\(model_type\) gives one\), got 'llama'"
    ):
        hf.unregister("llama")
    with pytest.raises(TypeError, match=r"family_of needs a model_type string, got \['llama'\] \(a list\)"):
        hf.family_of(["llama"])
    assert hf.family_of("llama") is hf.family_of("llama")


@pytest.mark.parametrize(
    "rule, field, where",
    [
        (dict(method=lambda config, layer: 1 / 0), "method", " at layer 0"),
        (dict(window=lambda config, layer: [][layer]), "window", " at layer 0"),
        (dict(check=lambda config: config.missing_field), "check", ""),
    ],
)
def test_a_rule_that_fails_is_named_with_its_family(rule, field, where):
    toy = hf.register(hf.Family(("toy_nope_llama",), **rule))
    try:
        with pytest.raises(hf.RuleError, match=rf"^family 'toy_nope_llama': its {field} rule failed{where} \("):
            hf.describe_config(_toy_config())
    finally:
        hf.unregister(toy)


def test_a_window_rule_that_gives_no_window_pair_is_named():
    toy = hf.register(hf.Family(("toy_nope_llama",), window=lambda config, layer: "xx"))
    try:
        with pytest.raises(
            hf.ConfigError,
            match=r"^family 'toy_nope_llama': its window rule gave 'xx' at layer 0, not "
            r"\(sliding window, chunk\)",
        ):
            hf.describe_config(_toy_config())
    finally:
        hf.unregister(toy)
